"""PowerThermalCallback under the real NeMo 2.7.3 stack on CPU: ``nl.Trainer`` + ``MegatronStrategy``
training a tiny ``llm.GPTModel`` (directly, and through a shrunk ``llm.llama3_8b.pretrain_recipe()``
with the callback appended as ``run.Config``), a tiny ``llm.MixtralModel``, and a plain Lightning
Trainer. Each training runs in its own process (NeMo initialises megatron-core's global state
once a process); the child writes what the test asserts on as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import require
from tests.sinks.wandb_steps import assert_every_step_in_wandb

REPO = Path(__file__).resolve().parents[2]

CHILD_PRELUDE = """
import json, os, sys, tempfile
sys.path.insert(0, {repo!r})
from tests.integrations import nemo_cpu
nemo_cpu.enable(os.path.join({tmp!r}, "nemorun"))
from collections import Counter
from charllm_nemo.integrations.nemo import PowerThermalCallback
from charllm_nemo.telemetry.reader import load_run

def summary(run_dir, csv_dir=None):
    r = load_run(run_dir)
    w = r.windows.to_pylist()
    steps = [json.loads(line) for line in open(os.path.join(run_dir, "steps.jsonl"))]
    keys = set()
    if csv_dir is not None:
        import csv, glob
        for f in glob.glob(os.path.join(csv_dir, "**", "metrics.csv"), recursive=True):
            with open(f) as fh:
                for row in csv.DictReader(fh):
                    keys |= {{k for k, v in row.items() if v not in ("", None)}}
    return {{
        "windows": [[x["kind"], x["name"], x["step"], x["microbatch"]] for x in w],
        "samples": r.samples.num_rows,
        "steps": steps,
        "manifest": r.manifests[0].get("config", {{}}).get("integration", {{}}),
        "logged_keys": sorted(keys),
    }}
"""


def _run_child(tmp_path: Path, body: str, timeout: float = 420) -> dict[str, Any]:
    require("nemo.collections.llm")
    script = CHILD_PRELUDE.format(repo=str(REPO), tmp=str(tmp_path)) + textwrap.dedent(body)
    out = tmp_path / "result.json"
    env = dict(os.environ, RESULT=str(out), PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(
            f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _assert_megatron_windows(result: dict[str, Any], steps: int, microbatches: int) -> None:
    kinds = Counter((k, n) for k, n, _s, _m in result["windows"])
    assert kinds[("step", "step")] == steps
    # one microbatch window per microbatch, each spanning its forward and its backward (timers)
    assert kinds[("microbatch", "microbatch")] == steps * microbatches
    assert kinds[("phase", "forward")] == steps * microbatches
    assert kinds[("phase", "backward")] == steps * microbatches
    assert kinds[("phase", "optimizer")] == steps
    mb_of_step = Counter(s for k, _n, s, _m in result["windows"] if k == "microbatch")
    assert mb_of_step == {s: microbatches for s in range(steps)}
    assert result["samples"] > 0
    src = result["manifest"]["sources"]
    assert "forward-compute" in src["phase:forward"] and "backward-compute" in src["phase:backward"]
    assert result["manifest"]["framework"] == "nemo"


def _assert_step_figures(result: dict[str, Any], steps: int) -> None:
    rows = result["steps"]
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        # the synthetic device draws between idle and its cap: energy = power x time, > 0
        assert r["energy_j"] > 0 and r["power_avg_w"] > 0
        assert r["energy_j"] == pytest.approx(r["power_avg_w"] * r["step_time_s"], rel=0.35)
        assert r["loss"] is not None and 0 < r["loss"] < 20
        assert r["tokens_per_s"] > 0 and r["model_tflops_per_gpu"] > 0


def test_tiny_gpt_under_nl_trainer_records_steps_microbatches_phases_and_logs(tmp_path: Path) -> None:
    result = _run_child(
        tmp_path,
        """
        from lightning.pytorch.loggers import CSVLogger
        from nemo import lightning as nl
        from nemo.collections import llm
        out = os.path.join(os.getcwd(), "run")
        cb = PowerThermalCallback(hz=200, backend="synthetic", out_dir=out, sampler="thread")
        model = llm.GPTModel(nemo_cpu.tiny_gpt_config(), optim=nemo_cpu.cpu_optimizer(),
                             tokenizer=nemo_cpu.ByteTokenizer())
        data = nemo_cpu.MaskedMockDataModule(seq_length=32, micro_batch_size=1, global_batch_size=2)
        trainer = nl.Trainer(accelerator="cpu", devices=1, max_steps=3, strategy=nemo_cpu.cpu_strategy(),
            plugins=nl.MegatronMixedPrecision(precision="32"), callbacks=[cb], logger=CSVLogger("csv"),
            enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1)
        inner = None
        trainer.fit(model, data)
        res = summary(out, "csv")
        res["microbatches_seen"] = cb.microbatches_seen
        res["megatron_steps_seen"] = cb.megatron_steps_seen
        res["timers_restored"] = type(model.config.timers).__module__
        json.dump(res, open(os.environ["RESULT"], "w"))
        """,
    )
    _assert_megatron_windows(result, steps=3, microbatches=2)
    _assert_step_figures(result, steps=3)
    assert result["microbatches_seen"] == 6  # NeMo's on_megatron_microbatch_end, 2 a step
    assert result["megatron_steps_seen"] == 3  # NeMo's on_megatron_step_start
    # NeMo's own Timers is back in model.config.timers after training
    assert result["timers_restored"] == "megatron.core.timers"
    # the trainer's loggers got the figures under the prefix; NeMo's own keys are still there
    for key in ("charllm/energy_j", "charllm/power_avg_w", "charllm/tokens_per_s", "reduced_train_loss"):
        assert key in result["logged_keys"], result["logged_keys"]


SHRUNK_LLAMA3 = """
        recipe = llm.llama3_8b.pretrain_recipe(name="tiny", dir=os.path.join(os.getcwd(), "nemo"),
                                               num_nodes=1, num_gpus_per_node=1)
        recipe.model = run.Config(llm.GPTModel, config=run.Config(nemo_cpu.tiny_gpt_config),
                                  tokenizer=run.Config(nemo_cpu.ByteTokenizer))
        recipe.optim = run.Config(nemo_cpu.cpu_optimizer)
        recipe.data = run.Config(nemo_cpu.MaskedMockDataModule, seq_length=32, micro_batch_size=1,
                                 global_batch_size=4)
        recipe.trainer.accelerator = "cpu"
        recipe.trainer.devices = 1
        recipe.trainer.max_steps = 2
        recipe.trainer.limit_val_batches = 0
        recipe.trainer.enable_checkpointing = False  # (dist_checkpointing syncs CUDA)
        recipe.trainer.val_check_interval = 10
        recipe.trainer.strategy = run.Config(nemo_cpu.cpu_strategy)
        recipe.trainer.plugins = run.Config(nl.MegatronMixedPrecision, precision="32")
        recipe.log = run.Config(nl.NeMoLogger, log_dir=os.path.join(os.getcwd(), "nemo"))
        recipe.resume = None
"""
"""NeMo 2.7.3's own llm.llama3_8b.pretrain_recipe(), shrunk for a CPU (a child body's lines)."""


def test_llama3_recipe_with_the_callback_as_run_config(tmp_path: Path) -> None:
    # the one line of docs/integrations.md, on llm.llama3_8b.pretrain_recipe() shrunk for a CPU
    result = _run_child(
        tmp_path,
        """
        import nemo_run as run
        from nemo import lightning as nl
        from nemo.collections import llm
        out = os.path.join(os.getcwd(), "run")
        """
        + SHRUNK_LLAMA3
        + """
        recipe.trainer.callbacks = [run.Config(PowerThermalCallback, hz=200, backend="synthetic",
                                               out_dir=out, sampler="thread")]
        run.run(recipe, direct=True)
        json.dump(summary(out), open(os.environ["RESULT"], "w"))
        """,
    )
    _assert_megatron_windows(result, steps=2, microbatches=4)
    _assert_step_figures(result, steps=2)


RECIPE_TINY = """
import nemo_run as run
from nemo import lightning as nl
from nemo.collections import llm
out = os.path.join(os.getcwd(), "run")
recipe = llm.llama3_8b.pretrain_recipe(name="tiny", dir=os.path.join(os.getcwd(), "nemo"),
                                       num_nodes=1, num_gpus_per_node=1)
recipe.model = run.Config(llm.GPTModel, config=run.Config(nemo_cpu.tiny_gpt_config),
                          tokenizer=run.Config(nemo_cpu.ByteTokenizer))
recipe.optim = run.Config(nemo_cpu.cpu_optimizer)
recipe.data = run.Config(nemo_cpu.MaskedMockDataModule, seq_length=32, micro_batch_size=1,
                         global_batch_size=2)
recipe.trainer.accelerator = "cpu"
recipe.trainer.devices = 1
recipe.trainer.limit_val_batches = 0
recipe.trainer.enable_checkpointing = False
recipe.trainer.val_check_interval = 10
recipe.trainer.strategy = run.Config(nemo_cpu.cpu_strategy)
recipe.trainer.plugins = run.Config(nl.MegatronMixedPrecision, precision="32")
recipe.resume = None
"""


def test_recipe_run_reports_nemos_grad_norm_and_writes_summary_json_for_inspect(tmp_path: Path) -> None:
    # the recipe's own TensorBoard logger on (NeMoLogger's default for pretrain recipes)
    result = _run_child(
        tmp_path,
        RECIPE_TINY
        + textwrap.dedent(
            """
        recipe.trainer.max_steps = 3
        recipe.trainer.log_every_n_steps = 2
        recipe.log = run.Config(nl.NeMoLogger, log_dir=os.path.join(os.getcwd(), "nemo"),
                                tensorboard=run.Config(__import__("lightning.pytorch.loggers",
                                    fromlist=["TensorBoardLogger"]).TensorBoardLogger,
                                    save_dir=os.path.join(os.getcwd(), "tb"), name="tiny"))
        recipe.trainer.callbacks = [run.Config(PowerThermalCallback, hz=200, backend="synthetic",
                                               out_dir=out, sampler="thread")]
        run.run(recipe, direct=True)
        import contextlib, glob, io
        from charllm_nemo import cli
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = cli.main(["inspect", out])
        res = summary(out)
        res["summary"] = json.load(open(os.path.join(out, "summary.json")))
        res["inspect"] = buf.getvalue()
        res["inspect_rc"] = rc
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        tags = set()
        for f in glob.glob(os.path.join(os.getcwd(), "**", "events.out.tfevents.*"), recursive=True):
            acc = EventAccumulator(f)
            acc.Reload()
            tags |= set(acc.Tags()["scalars"])
        res["tb_tags"] = sorted(tags)
        json.dump(res, open(os.environ["RESULT"], "w"))
        """
        ),
    )
    _assert_step_figures(result, steps=3)
    # item 5: NeMo's MegatronStrategy logs megatron-core's grad norm; every step carries it
    norms = [r["grad_norm"] for r in result["steps"]]
    assert all(n is not None and n > 0 for n in norms), norms
    # item 6: summary.json as charllm train writes it, and inspect reads it
    s = result["summary"]
    assert s["status"] == "complete" and s["steps"] == 3 and s["world_size"] == 1
    assert [r["step"] for r in s["per_step"]] == [0, 1, 2]
    assert [r["grad_norm"] for r in s["per_step"]] == norms
    assert s["step_time_s_median"] > 0 and s["energy_j_median"] > 0
    assert s["num_parameters"] > 0 and s["num_microbatches"] == 2
    assert "no summary.json" not in result["inspect"]
    assert "training: complete after 3 step(s)" in result["inspect"], result["inspect"]
    # the figures reached the recipe's TensorBoard logger (logged off the training thread)
    for key in ("charllm/energy_j", "charllm/grad_norm", "charllm/step_time_s"):
        assert key in result["tb_tags"], result["tb_tags"]


def test_tiny_mixtral_moe_logs_to_charllms_wandb_run(tmp_path: Path, wandb_env: dict[str, str]) -> None:
    # log_to="wandb" (offline): #40, the sink was never started and W&B got nothing
    result = _run_child(
        tmp_path,
        """
        from nemo import lightning as nl
        from nemo.collections import llm
        out = os.path.join(os.getcwd(), "run")
        cb = PowerThermalCallback(hz=200, backend="synthetic", out_dir=out, sampler="thread",
                                  log_to="wandb")
        model = llm.MixtralModel(nemo_cpu.tiny_mixtral_config(), optim=nemo_cpu.cpu_optimizer(),
                                 tokenizer=nemo_cpu.ByteTokenizer())
        data = nemo_cpu.MaskedMockDataModule(seq_length=32, micro_batch_size=1, global_batch_size=2)
        trainer = nl.Trainer(accelerator="cpu", devices=1, max_steps=2, strategy=nemo_cpu.cpu_strategy(),
            plugins=nl.MegatronMixedPrecision(precision="32"), callbacks=[cb], logger=False,
            enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(model, data)
        json.dump(summary(out), open(os.environ["RESULT"], "w"))
        """,
    )
    _assert_megatron_windows(result, steps=2, microbatches=2)
    _assert_step_figures(result, steps=2)
    assert_every_step_in_wandb(tmp_path / "run")  # every step's per-rank and all/* keys


def test_plain_lightning_trainer_gives_step_windows(tmp_path: Path, wandb_env: dict[str, str]) -> None:
    result = _run_child(
        tmp_path,
        """
        import time
        import torch
        import lightning.pytorch as pl
        from lightning.pytorch.loggers import CSVLogger

        class Tiny(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(16, 1)
            def training_step(self, batch, batch_idx):
                x, y = batch
                time.sleep(0.02)  # steps of ~4 sample periods: the W&B read-back asks a sampled peak
                return torch.nn.functional.mse_loss(self.lin(x), y)
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        data = torch.utils.data.TensorDataset(torch.randn(40, 16), torch.randn(40, 1))
        out = os.path.join(os.getcwd(), "run")
        cb = PowerThermalCallback(hz=200, backend="synthetic", out_dir=out, sampler="thread")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, callbacks=[cb],
                             logger=CSVLogger("csv"), enable_checkpointing=False,
                             enable_progress_bar=False, log_every_n_steps=1)
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
        res = summary(out, "csv")
        # again with log_to="wandb" (offline): charllm's W&B run instead of the trainer's loggers
        cb = PowerThermalCallback(hz=200, backend="synthetic", out_dir=out + "-wandb", sampler="thread",
                                  log_to="wandb")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[cb], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
        json.dump(res, open(os.environ["RESULT"], "w"))
        """,
    )
    assert_every_step_in_wandb(tmp_path / "run-wandb")
    kinds = Counter((k, n) for k, n, _s, _m in result["windows"])
    assert kinds[("step", "step")] == 5
    assert kinds[("phase", "optimizer")] == 5
    assert kinds[("microbatch", "microbatch")] == 0  # no Megatron timers: no microbatch windows
    assert result["manifest"]["framework"] == "lightning"
    rows = result["steps"]
    assert [r["step"] for r in rows] == list(range(5))
    assert all(r["energy_j"] > 0 and r["loss"] is not None for r in rows)
    assert rows[0]["tokens_per_s"] is None  # no model shape: no throughput invented
    assert "charllm/energy_j" in result["logged_keys"]


def test_an_exception_in_training_closes_the_telemetry_as_failed(tmp_path: Path) -> None:
    # the step that raises is cut short; the steps before it keep their windows and figures
    result = _run_child(
        tmp_path,
        """
        import torch
        import lightning.pytorch as pl

        class Boom(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 1)
            def training_step(self, batch, batch_idx):
                if self.global_step == 3:
                    raise RuntimeError("boom at step 3")
                return self.lin(batch[0]).pow(2).mean()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        data = torch.utils.data.TensorDataset(torch.randn(40, 4))
        out = os.path.join(os.getcwd(), "run")
        cb = PowerThermalCallback(hz=200, backend="synthetic", out_dir=out, sampler="thread")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[cb], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False)
        try:
            trainer.fit(Boom(), torch.utils.data.DataLoader(data, batch_size=4))
        except RuntimeError as exc:
            assert "boom" in str(exc)
        res = summary(out)
        res["status"] = load_run(out).manifests[0]["status"]
        res["closed"] = cb.telemetry is None
        json.dump(res, open(os.environ["RESULT"], "w"))
        """,
    )
    assert result["status"] == "failed" and result["closed"]
    steps = [s for k, _n, s, _m in result["windows"] if k == "step"]
    assert sorted(steps)[:3] == [0, 1, 2]


def test_grad_norm_is_read_fresh_each_step_and_a_stale_one_is_none() -> None:
    # Lightning keeps a logged value across steps: a step whose norm NeMo did not log anew
    # (the optimizer returned none) must not repeat the last one
    require("lightning.pytorch")
    import torch

    from charllm_nemo.integrations.nemo import _LoggedGradNorm

    class Metric:
        def __init__(self, v: float) -> None:
            self._forward_cache = torch.tensor(v)

    class Trainer:
        def __init__(self) -> None:
            self._results: dict[str, Any] = {}

    read = _LoggedGradNorm()
    t = Trainer()
    assert read(t) is None  # nothing logged it (a plain Lightning module)
    t._results = {"training_step.reduced_train_loss": Metric(5.0), "optimizer_step.grad_norm": Metric(1.5)}
    assert read(t) == pytest.approx(1.5)
    assert read(t) is None  # the same cached value next step: not logged anew
    t._results["optimizer_step.grad_norm"]._forward_cache = torch.tensor(0.75)
    assert read(t) == pytest.approx(0.75)
    t._results = {"training_step.grad_norm": Metric(2.0)}  # another collection, another key: found
    assert read(t) == pytest.approx(2.0)


BAD_OPTIONS = {
    "hz=0": "hz=0",
    "hz='x'": "hz='x'",
    "hz=-5": "hz=-5",
    "hz=float('nan')": "hz=nan",
    "counter_hz=0": "counter_hz=0",
    "backend='nvm'": "backend='nvm'",
    "sampler='proces'": "sampler='proces'",
    "windows=['stepp']": "windows has unknown kinds ['stepp']",
    "out_dir=a_file": "out_dir=",
    "peak_tflops_per_gpu=-1": "peak_tflops_per_gpu=-1",
    "precision='fp7'": "precision='fp7'",
    "hzz=100": "hzz",
}


def test_llama3_recipe_refuses_each_bad_option_before_a_model_is_built(tmp_path: Path) -> None:
    # #34: run.Config(PowerThermalCallback, <bad>) fails when Fiddle builds the callback, in one
    # line naming the keyword as written, and NeMo never configures the model
    cases = ", ".join(f"({k!r}, dict({k}))" for k in BAD_OPTIONS)
    result = _run_child(
        tmp_path,
        f"""
        import nemo_run as run
        from nemo import lightning as nl
        from nemo.collections import llm
        a_file = os.path.join(os.getcwd(), "a-file")
        open(a_file, "w").close()
        built = []
        _configure = llm.GPTModel.configure_model
        def configure_model(self, *a, **k):
            built.append(1)
            return _configure(self, *a, **k)
        llm.GPTModel.configure_model = configure_model
{SHRUNK_LLAMA3}        got = {{}}
        for name, bad in [{cases}]:
            options = {{"backend": "synthetic", "sampler": "thread", **bad}}
            try:
                recipe.trainer.callbacks = [run.Config(PowerThermalCallback, **options)]
                run.run(recipe, direct=True)
                got[name] = None
            except Exception as exc:
                got[name] = [type(exc).__name__, str(exc), len(built)]
        cb = PowerThermalCallback(windows="step", backend="synthetic")
        got["windows"] = list(cb.options.windows)
        json.dump(got, open(os.environ["RESULT"], "w"))
        """,
    )
    assert result.pop("windows") == ["step"]  # a string is one window kind, not its letters
    # an unknown keyword: Fiddle refuses it already in run.Config, against the signature made
    # from the one declaration (TypeError naming it)
    kind, message, models_built = result.pop("hzz=100")
    assert kind == "TypeError" and "hzz" in message and models_built == 0
    for name, expected in BAD_OPTIONS.items():
        if name == "hzz=100":
            continue
        assert result[name] is not None, f"{name} was accepted"
        kind, message, models_built = result[name]
        ours, *fiddles = [line for line in message.splitlines() if line.strip()]
        assert kind == "ConfigError" and expected in ours, (name, result[name])
        assert ours.startswith("PowerThermalCallback: ") and "telemetry." not in ours  # as written
        # after our one line, only Fiddle's one line of where (no traceback wall)
        assert all(line.startswith("Fiddle context:") for line in fiddles), message
        assert models_built == 0, f"{name}: NeMo configured the model before refusing"


def test_after_sigterm_the_manifest_and_summary_json_say_the_same_word(tmp_path: Path) -> None:
    # #40: the session's SIGTERM handler closed the manifest as "terminated", then Lightning's
    # handler raised and on_exception wrote summary.json as "failed"
    result = _run_child(
        tmp_path,
        """
        import signal
        import torch
        import lightning.pytorch as pl

        class Killed(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 1)
            def training_step(self, batch, batch_idx):
                if self.global_step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)  # what SLURM sends before the end
                return self.lin(batch[0]).pow(2).mean()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        data = torch.utils.data.TensorDataset(torch.randn(40, 4))
        out = os.path.join(os.getcwd(), "run")
        cb = PowerThermalCallback(hz=200, backend="synthetic", out_dir=out, sampler="thread")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[cb], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False)
        try:
            trainer.fit(Killed(), torch.utils.data.DataLoader(data, batch_size=4))
        except BaseException as exc:
            print("fit raised", type(exc).__name__)
        res = {"manifest": load_run(out).manifests[0]["status"],
               "summary": json.load(open(os.path.join(out, "summary.json")))["status"]}
        json.dump(res, open(os.environ["RESULT"], "w"))
        """,
    )
    assert result["manifest"] == result["summary"] == "terminated", result
