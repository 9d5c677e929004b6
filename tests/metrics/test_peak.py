"""Peak dense rates: the names NVML / AMD SMI / torch report, and never a guess."""

from __future__ import annotations

import pytest

from charllm_nemo.errors import ConfigError
from charllm_nemo.metrics.peak import DTYPES, PEAK_TABLE, identify_device, lookup_peak_tflops, normalize_dtype


@pytest.mark.parametrize(
    ("name", "bf16"),
    [
        # nvmlDeviceGetName / torch.cuda.get_device_name forms
        ("NVIDIA H100 80GB HBM3", 989.4),  # H100 SXM5
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),  # H200 SXM: the H100 SXM chip with more memory
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA H800", 989.4),
        ("NVIDIA H800 PCIe", 756.0),
        ("NVIDIA GH200 480GB", 989.4),
        ("NVIDIA GH200 144G HBM3e", 989.4),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-SXM4-40GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A800-SXM4-80GB", 312.0),
        ("NVIDIA A800 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.05),
        # AMD SMI market names; MI250/MI250X rates are per GCD, the device a rank sees
        ("AMD Instinct MI250X", 383.0 / 2),
        ("AMD Instinct MI250", 362.1 / 2),
        ("AMD INSTINCT MI250 (MCM) OAM AC MBA", 362.1 / 2),
        ("AMD Instinct MI210", 181.0),
        ("AMD Instinct MI300X", 1307.4),
        ("AMD Instinct MI300X VF", 1307.4),
        ("AMD Instinct MI300A", 980.6),
        ("AMD Instinct MI325X", 1307.4),
    ],
)
def test_known_device_names(name: str, bf16: float) -> None:
    assert lookup_peak_tflops(name) == pytest.approx(bf16)
    assert lookup_peak_tflops(name, "bf16") == lookup_peak_tflops(name, "fp16")


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA H100",  # SXM or PCIe? the bare name does not say
        "NVIDIA H20",  # 148 TFLOP/s, not an H200
        "NVIDIA L40",  # not an L40S
        "NVIDIA A10",
        "NVIDIA A100X",
        "NVIDIA A800 40GB Active",
        "NVIDIA GeForce RTX 4090",
        "AMD Instinct MI308X",
        "AMD Instinct MI250X / MI250",  # both products report this; see the compute-unit test
        "Aldebaran/MI200 [Instinct MI250X/MI250]",
        "NVIDIA H100 80GB HBM3 MIG 3g.40gb",  # a slice, size unknown
        "cpu",
        "AMD EPYC 9654 96-Core Processor",
        "",
    ],
)
def test_unknown_or_ambiguous_is_none(name: str) -> None:
    assert lookup_peak_tflops(name) is None


def test_mi250x_or_mi250_settled_by_compute_units() -> None:
    name = "AMD Instinct MI250X / MI250"
    assert lookup_peak_tflops(name, compute_units=110) == pytest.approx(191.5)
    assert lookup_peak_tflops(name, compute_units=104) == pytest.approx(181.05)
    assert lookup_peak_tflops(name, compute_units=96) is None
    entry = identify_device(name, compute_units=110)
    assert entry is not None and entry.key == "mi250x"


def test_partitions_scale_with_compute_units() -> None:
    # MI300X in CPX mode: 8 devices of 38 CUs each; a full device has 304.
    assert lookup_peak_tflops("AMD Instinct MI300X", compute_units=38) == pytest.approx(1307.4 / 8)
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", compute_units=132) == pytest.approx(989.4)
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3 MIG 3g.40gb", compute_units=60) == pytest.approx(
        989.4 * 60 / 132
    )
    # More SMs than the product has: the name and the count disagree, so no answer.
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", compute_units=132) is None


def test_other_dtypes() -> None:
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(1978.9)
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "tf32") == pytest.approx(494.7)
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5)
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156.0)
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no FP8
    assert lookup_peak_tflops("AMD Instinct MI300X", "fp8") == pytest.approx(2614.9)
    assert lookup_peak_tflops("AMD Instinct MI250X", "fp32") == pytest.approx(95.7 / 2)
    assert lookup_peak_tflops("AMD Instinct MI250X", "bfloat16") == pytest.approx(191.5)
    assert lookup_peak_tflops("NVIDIA B200", "tf32") is None  # not in the table: not guessed


def test_dtype_spellings() -> None:
    assert normalize_dtype("BF16") == "bf16"
    assert normalize_dtype("bf16-mixed") == "bf16"
    assert normalize_dtype("torch.float16") == "fp16"
    assert normalize_dtype("32-true") == "fp32"
    assert set(DTYPES) == {"bf16", "fp16", "fp8", "tf32", "fp32"}
    with pytest.raises(ConfigError, match="dtype"):
        lookup_peak_tflops("NVIDIA H100 80GB HBM3", "int8")


def test_override_wins_and_cpu_needs_one() -> None:
    assert lookup_peak_tflops("cpu") is None
    assert lookup_peak_tflops("cpu", override_tflops=1.5) == 1.5
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", override_tflops=700) == 700.0
    assert lookup_peak_tflops("anything", "not-a-dtype", override_tflops=2.0) == 2.0
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ConfigError, match="override_tflops"):
            lookup_peak_tflops("cpu", override_tflops=bad)
    with pytest.raises(ConfigError, match="compute_units"):
        lookup_peak_tflops("AMD Instinct MI300X", compute_units=0)


def test_table_entries_cite_a_source_and_are_dense_rates() -> None:
    for key, entry in PEAK_TABLE.items():
        assert entry.key == key
        assert entry.source
        assert set(entry.tflops) <= set(DTYPES)
        assert entry.tflops["bf16"] > 0
        # Dense FP8 is twice dense BF16 wherever both are listed (the L40S sheet rounds 724
        # to 733 and 181 to 183, hence 2 %): a check against a sparse rate slipping in.
        if "fp8" in entry.tflops:
            assert entry.tflops["fp8"] == pytest.approx(2 * entry.tflops["bf16"], rel=0.02)
        if "tf32" in entry.tflops:
            assert entry.tflops["tf32"] == pytest.approx(entry.tflops["bf16"] / 2, rel=0.02)


def test_h200_is_h100_sxm_compute_but_h200_nvl_is_not() -> None:
    assert PEAK_TABLE["h200_sxm"].tflops == PEAK_TABLE["h100_sxm"].tflops
    assert PEAK_TABLE["h200_nvl"].tflops["bf16"] < PEAK_TABLE["h200_sxm"].tflops["bf16"]
