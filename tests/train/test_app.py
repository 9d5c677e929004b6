"""The Hydra application: composition into TrainConfig, run directories, launching, signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from charllm_nemo.errors import ConfigError
from charllm_nemo.train import app, config_io
from charllm_nemo.train.config import TrainConfig, for_device
from charllm_nemo.train.config_io import load_train_config, run_id, save_train_config, train_config_from
from charllm_nemo.train.launch import local_gpu_count
from charllm_nemo.train.presets import model_preset, parallel_preset
from charllm_nemo.train.worker import main as worker_main
from tests.deadline import deadline

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


# -- composition ---------------------------------------------------------------------------------


def test_defaults_compose_to_a_typed_config() -> None:
    cfg = app.load()
    assert isinstance(cfg, TrainConfig)
    assert cfg.model == model_preset("tiny_gpt")
    assert cfg.parallel == parallel_preset("single")
    assert (cfg.optim.name, cfg.telemetry.backend, cfg.launch.launcher, cfg.launch.nproc) == (
        "base",
        "auto",
        "local",
        1,
    )
    assert cfg.telemetry.out_dir.startswith("runs/") and "${" not in cfg.telemetry.out_dir


def test_overrides_reach_every_section() -> None:
    cfg = app.load(
        [
            "model=tiny_moe",
            "parallel=tp2",
            "optim=recompute",
            "telemetry=synthetic",
            "launch.nproc=2",
            "batch.global_batch_size=8",
            "model.num_layers=8",
            "parallel.pipeline_layout=[5,3]",
            "data.seed=7",
        ]
    )
    assert (cfg.model.name, cfg.model.num_layers, cfg.model.num_experts) == ("tiny_moe", 8, 4)
    assert (cfg.parallel.tp, cfg.parallel.pipeline_layout) == (2, [5, 3])
    assert (cfg.optim.recompute_granularity, cfg.telemetry.backend) == ("full", "synthetic")
    assert (cfg.launch.nproc, cfg.batch.global_batch_size, cfg.data.seed) == (2, 8, 7)


def test_the_dry_runs_energy_platform_is_a_key_of_the_command_line() -> None:
    # docs/compare-energy.md's `launch.platform="NVIDIA H200"`: Hydra refused the key (not in struct)
    assert app.load([]).launch.platform is None
    assert app.load(["launch.platform=NVIDIA H200"]).launch.platform == "NVIDIA H200"


def test_nproc_shorthand_and_launcher_group() -> None:
    assert app.load(["nproc=4"]).launch.nproc == 4
    assert app.load(["launch.nproc=3"]).launch.nproc == 3
    cfg = app.load(["launcher=slurm", "launch.master_port=29600"])
    assert (cfg.launch.launcher, cfg.launch.master_port) == ("slurm", 29600)
    assert app.load(["launcher=none"]).launch.launcher == "none"


def test_wrong_types_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"batch.micro_batch_size: Value 'two'.*could not be converted"):
        app.load(["batch.micro_batch_size=two"])


def test_run_directory_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    dcfg = app.compose()
    assert OmegaConf.select(dcfg, "telemetry.out_dir") == OmegaConf.select(dcfg, "telemetry.out_dir")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert app.load(["launcher=slurm"]).telemetry.out_dir == "runs/slurm-4242.3"
    assert app.load().telemetry.out_dir != "runs/slurm-4242.3"  # a local run in an allocation
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # requeued: the killed attempt's directory stays
    assert app.load(["launcher=slurm"]).telemetry.out_dir == "runs/slurm-4242.3-restart2"
    monkeypatch.setenv("CHARLLM_RUN_ID", "mine")
    assert app.load(["launcher=slurm"]).telemetry.out_dir == "runs/mine"


def test_run_id_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHARLLM_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert run_id("none")[0].isdigit()  # torchrun's placeholder id is not used
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert run_id("none") == "torchrun-abc"


def test_recipes_compose() -> None:
    search = f"hydra.searchpath=[file://{REPO / 'conf'}]"
    for name, swept in (
        ("paper_optim_sweep", {"optim"}),
        ("paper_gpt3_175b_layouts", {"parallel", "optim"}),
        ("cpu_smoke", {"parallel"}),
    ):
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(REPO / "recipes"), version_base="1.3"):
            dcfg = compose(config_name=name, overrides=[search], return_hydra_config=True)
        assert set(dcfg.hydra.sweeper.params) == swept, name
        assert str(dcfg.hydra.mode) == "RunMode.MULTIRUN"
        OmegaConf.set_struct(dcfg, False)
        del dcfg["hydra"]
        cfg = train_config_from(dcfg)
        if name == "paper_gpt3_175b_layouts":
            assert (cfg.model.name, cfg.launch.launcher, cfg.batch.global_batch_size) == (
                "gpt3_175b",
                "slurm",
                1536,
            )


def test_conf_dir_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert app.find_conf_dir() == REPO / "conf"
    monkeypatch.setenv(config_io.CONF_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match=r"has no train\.yaml"):
        app.find_conf_dir()
    monkeypatch.setenv(config_io.CONF_ENV, str(REPO / "conf"))
    assert app.find_conf_dir() == REPO / "conf"


def test_packaged_conf_is_the_checkouts() -> None:
    # src/charllm_nemo/conf is a symlink to conf/: wheels package the same files.
    packaged = REPO / "src" / "charllm_nemo" / "conf"
    assert packaged.resolve() == (REPO / "conf").resolve()


# -- config files --------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_round_trip(tmp_path: Path, suffix: str) -> None:
    cfg = app.load(["model=tiny_moe", "parallel=pp2_uneven", "+extra.note=hi"])
    assert cfg.extra == {"note": "hi"}
    path = save_train_config(cfg, tmp_path / f"config{suffix}")
    assert load_train_config(path) == cfg


def test_config_yaml_keeps_no_secret_and_the_ranks_still_get_it(
    tmp_path: Path, fake_worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A token given as an override was stored in plaintext in config.yaml (and so in the W&B
    # artifact); the ranks read that same file, so they must get the real value another way.
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "run"
    secret = "hf_" + "Zq9" * 12
    overrides = [f"telemetry.out_dir={out}", f"+extra.hf_token={secret}", "+extra.num_tokens=7"]
    assert app.main(overrides) == 0
    text = (out / "config.yaml").read_text()
    assert secret not in text and "hf_token: <redacted>" in text and "num_tokens: 7" in text
    assert "moe_token_dispatcher: allgather" in text  # an ordinary name that contains "token"
    rank0 = json.loads((out / "fake" / "rank0.json").read_text())
    assert rank0["extra"] == {"hf_token": secret, "num_tokens": 7}
    assert list((tmp_path / "tmp").iterdir()) == []  # the ranks' private copy is gone
    assert load_train_config(out / "config.yaml").extra["hf_token"] == "<redacted>"


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_train_config(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("batch: {micro_batch_size: many}\n")
    with pytest.raises(ConfigError, match=r"batch\.micro_batch_size"):
        load_train_config(tmp_path / "bad.yaml")


# -- main: validate, write, launch ---------------------------------------------------------------


def test_main_trains_with_the_local_launcher(
    tmp_path: Path, fake_worker: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = app.main(
        ["model=tiny_gpt", "parallel=tp2", "nproc=2", "batch.global_batch_size=8", f"telemetry.out_dir={out}"]
    )
    assert rc == 0
    assert capsys.readouterr().err.endswith(f"charllm train: run directory {out} (charllm inspect {out})\n")
    saved = load_train_config(out / "config.yaml")
    assert (saved.parallel.tp, saved.launch.nproc, saved.launch.device) == (2, 2, "cpu")
    assert saved.telemetry.out_dir == str(out)
    ports = set()
    for rank in (0, 1):
        info = json.loads((out / "fake" / f"rank{rank}.json").read_text())
        assert info["env"]["RANK"] == str(rank) and info["env"]["WORLD_SIZE"] == "2"
        assert info["env"]["MASTER_ADDR"] == "127.0.0.1" and info["tp"] == 2
        ports.add(info["env"]["MASTER_PORT"])
    assert len(ports) == 1


def test_main_rejects_a_bad_layout_before_starting_anything(
    tmp_path: Path, fake_worker: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = app.main(["parallel=tp2pp2", "nproc=3", f"telemetry.out_dir={out}"])
    assert rc == app.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "world_size=3 is not divisible by parallel.tp*pp*cp=4" in err
    assert not out.exists()


def test_a_run_directory_holding_an_earlier_run_is_refused_or_replaced(
    tmp_path: Path, fake_worker: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    # An earlier run of 3 ranks: its store files, rank 0's files, and files that are not ours.
    for rank in range(3):
        (out / f"rank={rank}").mkdir(parents=True)
        (out / f"rank={rank}" / "manifest.json").write_text("{}")
        (out / f"rank={rank}" / "samples-000007.parquet").write_bytes(b"old")
    (out / "summary.json").write_text("{}")
    (out / "steps.jsonl").write_text("{}\n")
    (out / "rank=2" / "notes.txt").write_text("mine")
    args = ["nproc=2", f"telemetry.out_dir={out}"]
    assert app.main(args) == app.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"telemetry.out_dir={str(out)!r} already holds a run (steps.jsonl, summary.json" in err
    assert "(8 files)); give a new directory" in err and "telemetry.overwrite=true" in err
    assert not (out / "fake").exists() and (out / "rank=2" / "samples-000007.parquet").exists()

    assert app.main([*args, "telemetry.overwrite=true"]) == 0
    assert "replaced the earlier run in" in capsys.readouterr().err
    assert (out / "fake" / "rank1.json").exists()  # the ranks ran
    assert app.previous_run_files(out) == []  # rank=2 too, which this 2-rank run would not touch
    assert (out / "rank=2" / "notes.txt").read_text() == "mine"  # not ours: kept, and its folder


def test_replacing_a_run_of_more_ranks_leaves_no_empty_rank_folder_or_old_rank_log(tmp_path: Path) -> None:
    # An empty rank=2/ would read as a rank without a manifest, logs/rank2.log as that rank's.
    out = tmp_path / "run"
    for rank in range(3):
        (out / f"rank={rank}").mkdir(parents=True)
        (out / f"rank={rank}" / "manifest.json").write_text("{}")
    (out / "logs").mkdir()
    (out / "logs" / "rank2.log").write_text("old")
    cfg = TrainConfig()
    cfg.telemetry.out_dir, cfg.telemetry.overwrite = str(out), True
    app.check_run_dir(cfg, removes=True)
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_rank_folder_linked_to_another_run_is_in_the_way_and_only_the_link_goes(tmp_path: Path) -> None:
    # overwrite removed the store files of the run the link pointed at, through the link.
    other = tmp_path / "other" / "rank=0"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text("{}")
    out = tmp_path / "run"
    out.mkdir()
    (out / "rank=0").symlink_to(other)
    assert app.previous_run_files(out) == [out / "rank=0"]
    cfg = TrainConfig()
    cfg.telemetry.out_dir, cfg.telemetry.overwrite = str(out), True
    app.check_run_dir(cfg, removes=True)
    assert list(out.iterdir()) == [] and (other / "manifest.json").exists()


def test_file_names_in_the_refusal_are_escaped_for_the_terminal(tmp_path: Path) -> None:
    (tmp_path / "rank=0").mkdir()
    (tmp_path / "rank=0" / "samples-\x1b[2J.parquet").write_bytes(b"")
    cfg = TrainConfig()
    cfg.telemetry.out_dir = str(tmp_path)
    with pytest.raises(
        ConfigError, match=r"already holds a run \(rank=0/samples-\\x1b\[2J\.parquet\)"
    ) as err:
        app.check_run_dir(cfg, removes=True)
    assert "\x1b" not in str(err.value)


def test_a_run_directory_that_cannot_be_made_is_a_config_error_not_a_traceback(
    tmp_path: Path, fake_worker: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # Permissions alone pass for root; /proc refuses new folders to root too, so the check makes
    # (and removes) one folder there before anything starts.
    assert app.main(["telemetry.out_dir=/proc/charllm-test/run"]) == app.EXIT_CONFIG_ERROR
    err = capsys.readouterr().err  # the config check tries a folder there (#40): named, with the fix
    assert "telemetry.out_dir='/proc/charllm-test/run' cannot be written" in err and "writable" in err
    long_name = tmp_path / ("a" * 300)
    assert app.main([f"telemetry.out_dir={long_name}"]) == app.EXIT_CONFIG_ERROR
    assert "cannot be used (File name too long)" in capsys.readouterr().err


def test_a_dry_run_inside_an_allocation_with_a_garbled_environment_fails_as_the_run_would(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[01-04"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert app.main(["launcher=slurm", "dry_run=true"]) == app.EXIT_CONFIG_ERROR
    assert "cannot parse SLURM node list 'gpu[01-04'" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-04]")
    assert app.main(["launcher=slurm", "dry_run=true"]) == 0
    assert "dry run for 4 rank(s)" in capsys.readouterr().out


def test_only_the_launching_process_replaces_an_earlier_run(tmp_path: Path) -> None:
    # Under srun every task runs check_run_dir; rank 0 removes (before any rank can write, all
    # being held at the rendezvous), the others must neither remove nor refuse.
    cfg = TrainConfig()
    cfg.telemetry.out_dir = str(tmp_path)
    cfg.telemetry.overwrite = True
    (tmp_path / "summary.json").write_text("{}")
    app.check_run_dir(cfg, removes=False)
    assert (tmp_path / "summary.json").exists()
    app.check_run_dir(cfg, removes=True)
    assert not (tmp_path / "summary.json").exists()


def test_device_dependent_settings_are_resolved_once_and_recorded(tmp_path: Path, fake_worker: None) -> None:
    out = tmp_path / "run"
    assert app.main(["nproc=1", f"telemetry.out_dir={out}"]) == 0
    saved = load_train_config(out / "config.yaml")  # on CPU
    assert (saved.batch.precision, saved.optim.use_distributed_optimizer) == ("fp32", False)
    cfg = app.load([])
    assert (cfg.batch.precision, cfg.optim.use_distributed_optimizer) == ("auto", None)
    gpu, cpu = for_device(cfg, "cuda"), for_device(cfg, "cpu")
    assert (gpu.batch.precision, gpu.optim.use_distributed_optimizer) == ("bf16", True)  # as NeMo's recipes
    assert (cpu.batch.precision, cpu.optim.use_distributed_optimizer) == ("fp32", False)
    # PyTorch FSDP2 shards the optimizer itself: no distributed optimizer on top.
    fsdp2 = app.load(["parallel=fsdp_torch", "model.untie_embeddings=true"])
    assert for_device(fsdp2, "cuda").optim.use_distributed_optimizer is False
    cfg.batch.precision, cfg.optim.use_distributed_optimizer = "fp16", False
    assert for_device(cfg, "cuda") is cfg  # nothing automatic left


DRY_RUN_GPT3 = [
    "model=gpt3_175b",
    "parallel=gpt3_175b_tp8pp8",
    "optim=recompute",
    "nproc=1024",
    "launch.device=cuda",
    "batch.global_batch_size=1536",
    "dry_run=true",
]


@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_a_dry_run_prints_the_plan_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launcher: str
) -> None:
    # From a login node: no GPU, no SLURM allocation, a world size far beyond this host.
    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    assert app.main([*DRY_RUN_GPT3, f"launcher={launcher}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "charllm train: dry run for 1024 rank(s) on cuda: the configuration is valid; memory fit not "
        "checked (no launch.platform with known memory); nothing started"
    )
    text = "\n".join(out)
    assert "model=gpt3_175b: 174.575 B parameters; 96 layers" in text
    assert "world=1024 tp=8 pp=8 cp=1 ep=1 dp=16; layers/stage=[12, 12, 12, 12, 12, 12, 12, 12]" in text
    assert (
        "1536 sequences = 3,145,728 tokens, 96 microbatch(es) of 1 per data-parallel rank, precision bf16"
        in text
    )
    assert "with recomputation (x1.332)" in text
    # 2.797 B parameters on stage 0 (12 layers + the embedding, over tp=8): 2 + 4 bytes each, and
    # 12 over dp=16 (a GPU run's distributed optimizer, on by default).
    assert "(distributed optimizer: split over dp=16)" in text
    assert "stage 0: 12 layers, 2.797 B parameters: 17.6 GiB (weights 5.2 GiB" in text
    assert "stages 1-6: 12 layers, 2.718 B parameters" in text
    # Activations: full recomputation keeps each layer's input; 1F1B holds pp - stage microbatches.
    assert "(estimate; megatron-core's local layers: unfused attention keeps the s x s scores; " in text
    assert "stage 0: 8 microbatch(es) in flight: 4.5 GiB; peak 22.1 GiB" in text
    assert "stage 7: 1 microbatch(es) in flight: 772.0 MiB; peak 18.3 GiB" in text
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_dry_run_reports_an_invalid_config_like_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert app.main([*DRY_RUN_GPT3, "nproc=1000"]) == app.EXIT_CONFIG_ERROR
    assert "world_size=1000 is not divisible by parallel.tp*pp*cp=64" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_shows_how_experts_and_the_distributed_optimizer_split(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = app.load(
        [
            "model=mixtral_8x22b",
            "parallel=mixtral_8x22b_tp2pp8ep8_alternating",
            "optim=comm_overlap",
            "nproc=1024",
            "launch.device=cuda",
            "batch.global_batch_size=1024",
            "dry_run=true",
        ]
    )
    assert app.run(cfg) == 0
    text = capsys.readouterr().out
    assert "dp=64 expert_dp=8; layers/stage=[8, 6, 8, 6, 8, 6, 8, 6]" in text
    assert "(distributed optimizer: split over dp=64, experts over expert_dp=8)" in text
    assert "stage 1: 6 layers, 1.171 B parameters (906.0 M in experts)" in text


def test_a_local_launch_on_cuda_needs_a_gpu_per_rank(tmp_path: Path, fake_worker: None) -> None:
    out = tmp_path / "run"
    cfg = app.load(["nproc=2", "launch.device=cuda", "parallel=tp2", f"telemetry.out_dir={out}"])
    with pytest.raises(
        ConfigError, match=r"launch.nproc=2 ranks with launcher=local, but this host has 1 GPU"
    ):
        app.run(cfg, environ={"CUDA_VISIBLE_DEVICES": "3"})
    with pytest.raises(ConfigError, match=r"launch\.device=cuda but this host has no usable GPU"):
        app.run(cfg, environ={"CUDA_VISIBLE_DEVICES": "-1"})
    assert not out.exists()  # refused before the run directory


def test_local_gpu_count(tmp_path: Path) -> None:
    nvidia, kfd = tmp_path / "nvidia", tmp_path / "kfd"
    assert local_gpu_count({}, nvidia_dir=nvidia, kfd_topology=kfd) is None  # no driver: cannot tell
    for bus in ("0000:1b:00.0", "0000:43:00.0", "0000:52:00.0", "0000:61:00.0"):
        (nvidia / bus).mkdir(parents=True)
    assert local_gpu_count({}, nvidia_dir=nvidia, kfd_topology=kfd) == 4
    assert local_gpu_count({"CUDA_VISIBLE_DEVICES": "0,2"}, nvidia_dir=nvidia, kfd_topology=kfd) == 2
    assert local_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, nvidia_dir=nvidia, kfd_topology=kfd) == 4
    assert local_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, nvidia_dir=nvidia, kfd_topology=kfd) == 0
    # AMD: KFD nodes with compute units are GPUs; the CPU nodes have simd_count 0.
    for node, simds in enumerate([0, 304, 304, 0]):
        (kfd / str(node)).mkdir(parents=True)
        (kfd / str(node) / "properties").write_text(f"cpu_cores_count 0\nsimd_count {simds}\nmax_waves 10\n")
    assert local_gpu_count({}, nvidia_dir=tmp_path / "none", kfd_topology=kfd) == 2
    assert local_gpu_count({"HIP_VISIBLE_DEVICES": "1"}, nvidia_dir=tmp_path / "none", kfd_topology=kfd) == 1


def test_main_reports_hydra_errors_as_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert app.main(["model=gpt5"]) == app.EXIT_CONFIG_ERROR
    assert app.main(["batch.micro_batchsize=2"]) == app.EXIT_CONFIG_ERROR


def test_main_takes_a_port_the_os_gives_free_by_default(tmp_path: Path, fake_worker: None) -> None:
    # Not one fixed port every run on the host prefers: two runs starting together would both
    # find it free, and one rank 0 would fail to bind it seconds later.
    ports = set()
    for name in ("a", "b"):
        assert app.main(["nproc=2", f"telemetry.out_dir={tmp_path / name}"]) == 0
        env = [json.loads((tmp_path / name / "fake" / f"rank{r}.json").read_text())["env"] for r in (0, 1)]
        assert env[0]["MASTER_PORT"] == env[1]["MASTER_PORT"]
        ports.add(int(env[0]["MASTER_PORT"]))
    assert 29511 not in ports and all(1024 <= p <= 65535 for p in ports)


def test_main_picks_a_free_port_when_the_configured_one_is_busy(tmp_path: Path, fake_worker: None) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = tmp_path / "run"
        assert app.main(["nproc=2", f"launch.master_port={port}", f"telemetry.out_dir={out}"]) == 0
    used = json.loads((out / "fake" / "rank0.json").read_text())["env"]["MASTER_PORT"]
    assert used != str(port)


def test_main_propagates_a_rank_failure(
    tmp_path: Path, fake_worker: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHARLLM_FAKE_MODE", "fail:1:7")
    out = tmp_path / "run"
    rc = app.main(["nproc=3", "batch.global_batch_size=3", f"telemetry.out_dir={out}"])
    assert rc == 7
    assert "rank 1 failed with exit code 7" in capsys.readouterr().err
    # The other ranks were stopped with SIGTERM, and the worker's handler let them flush.
    assert (out / "fake" / "rank0.flushed").exists() and (out / "fake" / "rank2.flushed").exists()


def test_sweep_gives_each_job_its_own_run_directory(
    tmp_path: Path, fake_worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CHARLLM_RUN_ID", "sweep-test")
    rc = app.main(["-m", "parallel=tp2,pp2", "nproc=2"])
    assert rc == 0
    root = tmp_path / "runs" / "sweep-sweep-test"
    assert load_train_config(root / "0" / "config.yaml").parallel.name == "tp2"
    assert load_train_config(root / "1" / "config.yaml").parallel.name == "pp2"
    assert (root / "1" / "fake" / "rank1.json").exists()


def test_sigterm_reaches_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = dict(os.environ)
    env.update(
        CHARLLM_WORKER_TARGET="_fake_worker:run",
        CHARLLM_FAKE_MODE="hang",
        PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "charllm_nemo.train.app", "nproc=2", f"telemetry.out_dir={out}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        start_by = time.monotonic() + deadline(60)
        while not all((out / "fake" / f"rank{r}.ready").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < start_by, "ranks did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=deadline(30))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert b"got SIGTERM; forwarded it to 2 rank(s)" in err
    assert all((out / "fake" / f"rank{r}.flushed").exists() for r in (0, 1))


# -- in-process launchers ------------------------------------------------------------------------


class _Loop:
    """Stands in for charllm_nemo.train.loop (run_rank) in this process."""

    def __init__(self) -> None:
        self.calls: list[tuple[TrainConfig, dict[str, str]]] = []

    def run_rank(self, cfg: TrainConfig, session: object = None) -> None:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        self.calls.append((cfg, {k: os.environ[k] for k in keys}))


@pytest.fixture
def fake_loop(monkeypatch: pytest.MonkeyPatch) -> _Loop:
    loop = _Loop()
    monkeypatch.setitem(sys.modules, "charllm_nemo.train.loop", loop)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)  # restored after the test; run() sets them
    return loop


def test_slurm_launcher_runs_the_rank_in_process(
    tmp_path: Path, fake_loop: _Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "cn[3-4]",
             "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}  # fmt: skip
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    cfg = app.load(["launcher=slurm", "parallel=tp2", f"telemetry.out_dir={tmp_path}"])
    assert app.run(cfg) == 0
    ((ran, env),) = fake_loop.calls
    assert env == {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "cn3",
        "MASTER_PORT": "23936",  # launch.master_port auto: 10000 + (8 * 4242 + 0) % 20000
    }
    assert load_train_config(tmp_path / "config.yaml") == ran  # rank 0 wrote the resolved config


def test_slurm_launcher_validates_against_the_task_count(
    tmp_path: Path, fake_loop: _Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "3",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "a",
    }.items():
        monkeypatch.setenv(k, v)
    cfg = app.load(["launcher=slurm", "parallel=tp2", f"telemetry.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="world_size=3 is not divisible"):
        app.run(cfg)
    assert fake_loop.calls == []


def test_torchrun_launcher_uses_the_environment(
    tmp_path: Path, fake_loop: _Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "9",
    }.items():
        monkeypatch.setenv(k, v)
    cfg = app.load(["launcher=none", "parallel=pp2", f"telemetry.out_dir={tmp_path}"])
    assert app.run(cfg) == 0
    assert fake_loop.calls[0][1]["RANK"] == "1"
    assert not (tmp_path / "config.yaml").exists()  # only rank 0 writes it


# -- the worker ----------------------------------------------------------------------------------


def test_worker_runs_the_target_and_returns_its_code(
    tmp_path: Path, fake_worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("RANK", "0")
    cfg = app.load([f"telemetry.out_dir={tmp_path}"])
    path = save_train_config(cfg, tmp_path / "config.yaml")
    assert worker_main([str(path)]) == 0
    assert (tmp_path / "fake" / "rank0.json").exists()
    monkeypatch.setenv("CHARLLM_FAKE_MODE", "fail:0:4")
    assert worker_main([str(path)]) == 4


def test_a_rank_that_cannot_use_this_machine_says_why_without_a_traceback(
    tmp_path: Path, fake_worker: None, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # e.g. telemetry.backend=nvml where there is no driver: the package's own error, one line
    # (rank 0 writes to the launcher's own stderr: captured at the file descriptor).
    monkeypatch.setenv("CHARLLM_FAKE_MODE", "unavailable")
    assert app.main([f"telemetry.out_dir={tmp_path / 'run'}"]) == 2
    err = capfd.readouterr().err
    assert "rank 0: no NVIDIA driver found (a stand-in)" in err and "Traceback" not in err


def test_worker_usage_and_bad_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert worker_main([]) == 2
    cfg = app.load([f"telemetry.out_dir={tmp_path}"])
    path = save_train_config(cfg, tmp_path / "config.json")
    monkeypatch.setenv("CHARLLM_WORKER_TARGET", "no_colon")
    assert worker_main([str(path)]) == 2
    assert "must be 'module:function'" in capsys.readouterr().err


def test_a_config_file_is_read_through_the_hardened_reader(tmp_path: Path) -> None:
    cfg = app.load(["model=tiny_gpt"])
    path = save_train_config(cfg, tmp_path / "config.yaml")
    link = tmp_path / "linked.yaml"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="is a symbolic link; not followed"):
        load_train_config(link)
    (tmp_path / "huge.yaml").write_bytes(b"#" * (16 * 2**20 + 1))
    with pytest.raises(ConfigError, match="over the 16 MiB"):
        load_train_config(tmp_path / "huge.yaml")
    assert load_train_config(path) == cfg
