"""Peak dense (no 2:4 sparsity) tensor/matrix-core rates per device, for MFU.

Rates are vendor datasheet figures in TFLOP/s. NVIDIA datasheets print the sparse rate with a
footnote; the dense rate is half of it. AMD prints dense and sparse separately. Each entry
cites its source; docs/flops.md has the table.

Rates are per *logical device*, the unit that NVML / AMD SMI / torch enumerate and that a
rank's ``world_size`` counts: an MI250X package is two GCDs, each its own device with half the
package's rate. A device partitioned into fewer compute units (MIG slice, MI300X CPX mode) is
scaled by its compute-unit count when that count is given, and unknown otherwise.

An unknown or ambiguous device gives None, never a guess: MFU is then left empty rather than
wrong. ``override_tflops`` (e.g. ``TelemetryConfig.cpu_peak_tflops``) always wins.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from charllm_nemo.errors import ConfigError

# dtype spellings -> table key. "fp32" means FP32 GEMMs without TF32: the CUDA-core rate on
# NVIDIA (PyTorch's default torch.backends.cuda.matmul.allow_tf32 is False) and the FP32
# matrix-core rate on AMD CDNA (rocBLAS runs FP32 GEMMs on the matrix cores).
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "bf16": "bf16",
        "bfloat16": "bf16",
        "torch.bfloat16": "bf16",
        "bf16-mixed": "bf16",
        "bf16-true": "bf16",
        "fp16": "fp16",
        "float16": "fp16",
        "half": "fp16",
        "torch.float16": "fp16",
        "16": "fp16",
        "16-mixed": "fp16",
        "16-true": "fp16",
        "fp8": "fp8",
        "float8": "fp8",
        "e4m3": "fp8",
        "hybrid": "fp8",
        "tf32": "tf32",
        "fp32": "fp32",
        "float32": "fp32",
        "float": "fp32",
        "torch.float32": "fp32",
        "32": "fp32",
        "32-true": "fp32",
    }
)
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp8", "tf32", "fp32")


@dataclass(frozen=True, slots=True)
class DevicePeak:
    """Datasheet peak dense rates of one accelerator product, in TFLOP/s per package.

    ``devices_per_package``: logical devices the runtime shows per package (2 for MI250/MI250X).
    ``compute_units``: SMs / CUs of one unpartitioned logical device, None where not checked.
    """

    key: str
    name: str
    tflops: Mapping[str, float]
    source: str
    devices_per_package: int = 1
    compute_units: int | None = None
    notes: str = ""

    def per_device_tflops(self, dtype: str) -> float | None:
        """Rate of one logical device for ``dtype`` (a key of ``DTYPES``), TFLOP/s."""
        rate = self.tflops.get(dtype)
        return None if rate is None else rate / self.devices_per_package


def _rates(
    bf16: float,
    fp8: float | None = None,
    tf32: float | None = None,
    fp32: float | None = None,
    fp16: float | None = None,
) -> Mapping[str, float]:
    table = {"bf16": bf16, "fp16": bf16 if fp16 is None else fp16, "fp8": fp8, "tf32": tf32, "fp32": fp32}
    return MappingProxyType({k: v for k, v in table.items() if v is not None})


_NV_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 datasheet, sparse/2)"
_NV_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (H200 datasheet, sparse/2)"
_NV_H800 = "NVIDIA H800 Tensor Core GPU datasheet (nvidia.cn), sparse/2"
_NV_A100 = "https://www.nvidia.com/en-us/data-center/a100/ (A100 datasheet, sparse/2)"
_NV_A800 = "NVIDIA A800 Tensor Core GPU datasheet (nvidia.cn), sparse/2"
_NV_L40S = "https://www.nvidia.com/en-us/data-center/l40s/ (L40S datasheet, dense column)"
_NV_GH200 = "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/ (GH200 datasheet, sparse/2)"
_NV_B200 = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 per GPU, sparse/2)"
_NV_GB200 = "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (GB200 NVL72 / 72 GPUs, sparse/2)"
_AMD = "https://www.amd.com/en/products/accelerators/instinct/"

PEAK_TABLE: Mapping[str, DevicePeak] = MappingProxyType(
    {
        p.key: p
        for p in (
            DevicePeak(
                "h100_sxm",
                "NVIDIA H100 SXM5",
                _rates(989.4, 1978.9, 494.7, 67.0),
                _NV_H100,
                compute_units=132,
            ),
            DevicePeak(
                "h100_pcie",
                "NVIDIA H100 PCIe",
                _rates(756.0, 1513.0, 378.0, 51.0),
                _NV_H100,
                compute_units=114,
            ),
            DevicePeak(
                "h100_nvl",
                "NVIDIA H100 NVL",
                _rates(835.5, 1670.5, 417.5, 60.0),
                _NV_H100,
                compute_units=132,
                notes="2024 datasheet (1,671 BF16 sparse); the 2023 two-card sheet printed pair totals",
            ),
            DevicePeak(
                "h200_sxm",
                "NVIDIA H200 SXM",
                _rates(989.4, 1978.9, 494.7, 67.0),
                _NV_H200,
                compute_units=132,
                notes="same GH100 compute as H100 SXM; only memory differs",
            ),
            DevicePeak(
                "h200_nvl",
                "NVIDIA H200 NVL",
                _rates(835.5, 1670.5, 417.5, 60.0),
                _NV_H200,
                compute_units=132,
                notes="600 W PCIe card: lower clocks than H200 SXM",
            ),
            DevicePeak(
                "h800_sxm",
                "NVIDIA H800 SXM5",
                _rates(989.4, 1978.9, 494.7, 67.0),
                _NV_H800,
                compute_units=132,
                notes="H100 SXM compute; NVLink cut to 400 GB/s, FP64 cut",
            ),
            DevicePeak(
                "h800_pcie",
                "NVIDIA H800 PCIe",
                _rates(756.0, 1513.0, 378.0, 51.0),
                _NV_H800,
                compute_units=114,
            ),
            DevicePeak(
                "gh200",
                "NVIDIA GH200 Grace Hopper (GPU)",
                _rates(989.4, 1978.9, 494.7, 67.0),
                _NV_GH200,
                compute_units=132,
            ),
            DevicePeak(
                "a100",
                "NVIDIA A100 (SXM4 / PCIe, 40 / 80 GB)",
                _rates(312.0, None, 156.0, 19.5),
                _NV_A100,
                compute_units=108,
                notes="SXM and PCIe share the peak; the PCIe card sustains it less",
            ),
            DevicePeak(
                "a800",
                "NVIDIA A800 (SXM4 / PCIe 80 GB)",
                _rates(312.0, None, 156.0, 19.5),
                _NV_A800,
                compute_units=108,
                notes="A100 compute; NVLink cut to 400 GB/s",
            ),
            DevicePeak(
                "l40s",
                "NVIDIA L40S",
                _rates(362.05, 733.0, 183.0, 91.6),
                _NV_L40S,
                compute_units=142,
                notes="the sheet's own FP8 dense figure (733) is not exactly 2 x BF16 (724.1)",
            ),
            DevicePeak("b200", "NVIDIA B200 (HGX, 1000 W)", _rates(2250.0, 4500.0), _NV_B200),
            DevicePeak(
                "gb200", "NVIDIA GB200 (Blackwell GPU in GB200 NVL72)", _rates(2500.0, 5000.0), _NV_GB200
            ),
            DevicePeak(
                "mi250x",
                "AMD Instinct MI250X",
                _rates(383.0, None, None, 95.7),
                _AMD + "mi200/mi250x.html",
                devices_per_package=2,
                compute_units=110,
                notes="two GCDs per package, 110 CUs each",
            ),
            DevicePeak(
                "mi250",
                "AMD Instinct MI250",
                _rates(362.1, None, None, 90.5),
                _AMD + "mi200/mi250.html",
                devices_per_package=2,
                compute_units=104,
                notes="two GCDs per package, 104 CUs each",
            ),
            DevicePeak(
                "mi210",
                "AMD Instinct MI210",
                _rates(181.0, None, None, 45.3),
                _AMD + "mi200/mi210.html",
                compute_units=104,
            ),
            DevicePeak(
                "mi300x",
                "AMD Instinct MI300X",
                _rates(1307.4, 2614.9, 653.7, 163.4),
                _AMD + "mi300/mi300x.html",
                compute_units=304,
                notes="SPX mode; CPX mode = 8 devices",
            ),
            DevicePeak(
                "mi300a",
                "AMD Instinct MI300A",
                _rates(980.6, 1961.2, 490.3, 122.6),
                _AMD + "mi300/mi300a.html",
                compute_units=228,
            ),
            DevicePeak(
                "mi325x",
                "AMD Instinct MI325X",
                _rates(1307.4, 2614.9, 653.7, 163.4),
                _AMD + "mi300/mi325x.html",
                compute_units=304,
                notes="MI300X compute with HBM3E",
            ),
        )
    }
)


@dataclass(frozen=True, slots=True)
class _Rule:
    key: str
    pattern: re.Pattern[str]
    exclude: re.Pattern[str] | None = field(default=None)


def _rule(key: str, pattern: str, exclude: str | None = None) -> _Rule:
    return _Rule(key, re.compile(pattern), None if exclude is None else re.compile(exclude))


# Matched against the upper-cased name with '-', '_' and '/' turned into spaces. Word
# boundaries keep H20 (148 TFLOP/s) from matching H200, A100X / A10 from A100, L40 from L40S,
# MI308X from MI300X. First match wins, so the specific forms come first.
_NVIDIA_RULES: tuple[_Rule, ...] = (
    _rule("gh200", r"\bGH200\b"),
    _rule("gb200", r"\bGB200\b"),
    _rule("b200", r"\bB200\b"),
    _rule("h200_nvl", r"\bH200\b.*\bNVL\b"),
    _rule("h200_sxm", r"\bH200\b", exclude=r"\bPCIE\b"),
    _rule("h100_nvl", r"\bH100\b.*\bNVL\b"),
    _rule("h100_pcie", r"\bH100\b.*\bPCIE\b"),
    _rule("h100_sxm", r"\bH100\b.*\b(SXM\d*|HBM3E?)\b"),
    _rule("h800_pcie", r"\bH800\b.*\bPCIE\b"),
    _rule("h800_sxm", r"\bH800\b"),
    _rule("a100", r"\bA100\b"),
    _rule("a800", r"\bA800\b.*\b(SXM\d*|PCIE)\b"),
    _rule("l40s", r"\bL40S\b"),
)
_AMD_MODEL = re.compile(r"\bMI(\d{3})([A-Z]?)\b")
_AMD_FAMILIES = frozenset({"MI200", "MI300"})
_AMD_KEYS = {
    "MI250X": "mi250x",
    "MI250": "mi250",
    "MI210": "mi210",
    "MI300X": "mi300x",
    "MI300A": "mi300a",
    "MI325X": "mi325x",
}


def _normalize(device_name: str) -> str:
    return " ".join(re.sub(r"[-_/]", " ", device_name.upper()).split())


def identify_device(device_name: str, compute_units: int | None = None) -> DevicePeak | None:
    """The table entry for a name as NVML (``nvmlDeviceGetName``), AMD SMI (market name) or
    ``torch.cuda.get_device_name`` reports it, or None when unknown or ambiguous.

    ``compute_units`` (SMs / CUs of the device, e.g. torch's ``multi_processor_count`` or AMD
    SMI's ``num_compute_units``) settles "AMD Instinct MI250X / MI250", which both products
    report: 110 CUs per GCD = MI250X, 104 = MI250.
    """
    name = _normalize(device_name)
    if not name:
        return None
    # Family names (MI200, MI300) in board strings such as "Aldebaran/MI200 [Instinct
    # MI250X/MI250]" say nothing about the product.
    models = {m.group(0) for m in _AMD_MODEL.finditer(name)} - _AMD_FAMILIES
    if models:
        if models == {"MI250X", "MI250"}:
            by_cus = {PEAK_TABLE[k].compute_units: PEAK_TABLE[k] for k in ("mi250x", "mi250")}
            return by_cus.get(compute_units)
        if len(models) != 1:
            return None
        key = _AMD_KEYS.get(models.pop())
        return None if key is None else PEAK_TABLE[key]
    for rule in _NVIDIA_RULES:
        if rule.pattern.search(name) and not (rule.exclude and rule.exclude.search(name)):
            return PEAK_TABLE[rule.key]
    return None


def normalize_dtype(dtype: str) -> str:
    """Canonical dtype key ("bf16", "fp16", "fp8", "tf32", "fp32"); ConfigError if unknown."""
    key = _DTYPE_ALIASES.get(str(dtype).strip().lower())
    if key is None:
        raise ConfigError(f"dtype={dtype!r} is not known; use one of {list(DTYPES)}")
    return key


def lookup_peak_tflops(
    device_name: str,
    dtype: str = "bf16",
    *,
    override_tflops: float | None = None,
    compute_units: int | None = None,
) -> float | None:
    """Peak dense rate of one logical device in TFLOP/s, or None when not known.

    ``override_tflops`` (> 0) is returned as is: the way to give a CPU, an unlisted device, or
    a measured sustainable rate. A CPU without an override gives None. ``compute_units`` below
    the full device's count (a MIG slice, an MI300X CPX partition) scales the rate down; a
    MIG device name without ``compute_units`` gives None.
    """
    if override_tflops is not None:
        if (
            isinstance(override_tflops, bool)
            or not isinstance(override_tflops, (int, float))
            or not math.isfinite(override_tflops)
            or override_tflops <= 0
        ):
            raise ConfigError(
                f"override_tflops={override_tflops!r} must be a positive number of TFLOP/s "
                f"(e.g. telemetry.cpu_peak_tflops), or None to look the device up"
            )
        return float(override_tflops)
    key = normalize_dtype(dtype)
    if compute_units is not None and (
        isinstance(compute_units, bool) or not isinstance(compute_units, int) or compute_units < 1
    ):
        raise ConfigError(f"compute_units={compute_units!r} must be a positive integer or None")
    entry = identify_device(device_name, compute_units)
    if entry is None:
        return None
    rate = entry.per_device_tflops(key)
    if rate is None:
        return None
    partitioned = bool(re.search(r"\bMIG\b", _normalize(device_name)))
    if compute_units is None:
        return None if partitioned else rate
    if entry.compute_units is None:
        return None if partitioned else rate
    if compute_units > entry.compute_units:
        return None  # more units than the product has: the name and the count disagree
    return rate * compute_units / entry.compute_units
