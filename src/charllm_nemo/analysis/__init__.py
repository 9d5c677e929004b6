"""Tables, figures and an HTML report from run and sweep directories (docs/analysis.md).

``load`` finds runs and reads ranks through telemetry/layout.py; ``rank_tables`` and ``metrics``
reduce one rank with numpy; ``run_info``, ``run_summary`` and ``findings`` build the tables with
DuckDB SQL; ``analyze`` ties them together and writes them; ``figures*``, ``kernels`` and
``report`` draw and publish; ``commands`` is the ``charllm analyze`` / ``charllm report`` CLI;
``store_writer`` writes run directories from arrays (tests, benchmarks). Importing this package
imports none of DuckDB or matplotlib.
"""
