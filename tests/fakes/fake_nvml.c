/*
 * fake_nvml.c: a stand-in for libnvidia-ml.so.1, so that the real nvidia-ml-py bindings
 * (module `pynvml`) and everything above them run on a machine without an NVIDIA driver.
 *
 * Build (tests/fakes/nvml_stub.py does this and caches the result):
 *     gcc -O2 -shared -fPIC -pthread -Wl,-soname,libnvidia-ml.so.1 -o DIR/libnvidia-ml.so.1 fake_nvml.c
 *
 * Every entry point has the C signature and the struct layout of the real NVML (nvml.h from
 * CUDA 12/13): nvmlFieldValue_t is 40 bytes, nvmlMemory_v2_t 40, nvmlPciInfo_t 68, ...
 * Return codes are NVML's (NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_GPU_IS_LOST = 15, ...).
 *
 * ---------------------------------------------------------------------------------------
 * SCRIPT FORMAT: the file named by $FAKE_NVML_SCRIPT is read at the first nvmlInit after
 * the library is loaded (or after fake_nvml_reset()); fake_nvml_command() takes one line
 * of the same format from the same process (ctypes). One statement a line; '#' starts a
 * comment; tokens are separated by blanks.
 *
 *   Global statements:
 *     device_count N             number of GPUs (default 1, at most 16)
 *     driver_version STR         nvmlSystemGetDriverVersion (default 550.54.15)
 *     nvml_version STR           nvmlSystemGetNVMLVersion (default 12.550.54.15)
 *     cuda_driver_version N      nvmlSystemGetCudaDriverVersion[_v2] (default 12040)
 *     init_error ERR|OK          nvmlInit* returns ERR (e.g. DRIVER_NOT_LOADED)
 *
 *   Device statements: DEV KEY VALUE, DEV = an index or '*' (every device).
 *     Quantities (VALUE = an integer, decimal or 0x-hex, or an error name: the error is then
 *     returned by every entry point that serves the quantity; a number clears the error):
 *       power_instant_mw      field NVML_FI_DEV_POWER_INSTANT (186), scope GPU (0)
 *       power_average_mw      field NVML_FI_DEV_POWER_AVERAGE (185) and nvmlDeviceGetPowerUsage
 *       power_memory_mw       fields 185/186 with scopeId NVML_POWER_SCOPE_MEMORY (2)
 *       power_module_extra_mw fields 186 / 185 with scopeId NVML_POWER_SCOPE_MODULE (1) report
 *                             the GPU's instant (square wave included) / average power plus
 *                             this: the rest of a Grace module (CPU, its memory). Default
 *                             NOT_SUPPORTED, as on a GPU that is not part of a Grace module
 *       energy_mj             nvmlDeviceGetTotalEnergyConsumption, fields 83 and 191
 *                             (in dynamic mode: the counter's value at the start)
 *       temp_gpu_c            nvmlDeviceGetTemperature[V](NVML_TEMPERATURE_GPU)
 *       temp_gpu_max_c        the same with NVML_TEMPERATURE_GPU_MAX (hottest point, NVML 13)
 *       temp_memory_c         field NVML_FI_DEV_MEMORY_TEMP (82)
 *       clock_sm_mhz clock_mem_mhz clock_graphics_mhz       nvmlDeviceGetClockInfo
 *       clock_sm_max_mhz clock_mem_max_mhz clock_graphics_max_mhz  nvmlDeviceGetMaxClockInfo
 *       clocks_event_reasons  nvmlDeviceGetCurrentClocksEventReasons / ...ThrottleReasons
 *       violation_power_ns    field 74 and nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_POWER)
 *       violation_thermal_ns  field 75 and nvmlDeviceGetViolationStatus(NVML_PERF_POLICY_THERMAL)
 *       violation_sync_boost_ns violation_board_limit_ns violation_low_util_ns
 *       violation_reliability_ns violation_total_app_clocks_ns violation_total_base_clocks_ns
 *                             fields 76..81 and nvmlDeviceGetViolationStatus(policy 2..5, 10, 11)
 *       violation_sw_thermal_ns violation_hw_thermal_ns violation_hw_power_brake_ns
 *                             fields 269..271 (NVML_FI_DEV_CLOCKS_EVENT_REASON_*; no policy)
 *       violation_ts_us       the timestamp the violation fields and ViolationStatus's
 *                             referenceTime report (0, the default: the time of the call)
 *       power_smoothing_enabled power_smoothing_profile   fields 251 / 264 (default
 *                             NOT_SUPPORTED)
 *       workload_profiles_requested workload_profiles_enforced   the first 32 bits of the
 *                             masks nvmlDeviceWorkloadPowerProfileGetCurrentProfiles returns
 *                             (the call serves NOT_SUPPORTED while ..._requested is an error;
 *                             default NOT_SUPPORTED)
 *       util_gpu_pct util_mem_pct            nvmlDeviceGetUtilizationRates
 *       mem_total_bytes mem_used_bytes mem_reserved_bytes   nvmlDeviceGetMemoryInfo[_v2]
 *                             (v1 reports used + reserved as used, like the real library)
 *       power_limit_mw        nvmlDeviceGetEnforcedPowerLimit
 *       power_management_limit_mw  nvmlDeviceGetPowerManagementLimit, field 190
 *       power_default_limit_mw     nvmlDeviceGetPowerManagementDefaultLimit, field 189
 *       power_min_limit_mw power_max_limit_mw  ...LimitConstraints, fields 187/188
 *       pcie_tx_bytes pcie_rx_bytes   fields 197/198 (64-bit)
 *       nvlink_tx_kib nvlink_rx_kib   fields 138/139: scopeId 0xFFFFFFFF = all links, a link
 *                             id = that link's share (total / links, remainder on link 0)
 *       nvlink_links          number of links (default 18; field 91)
 *       architecture          nvmlDeviceGetArchitecture (default 9 = Hopper)
 *       cuda_cc_major cuda_cc_minor   nvmlDeviceGetCudaComputeCapability (default 9.0)
 *       c2c_enabled           nvmlDeviceGetC2cModeInfoV (default NOT_SUPPORTED)
 *     Strings: name STR, uuid STR, pci_bus_id STR (rest of the line).
 *     Behaviour:
 *       call_delay_us N       busy-wait N us in every device call (mimics ~20 us real calls)
 *       field_delay_us N      extra busy-wait per requested field in nvmlDeviceGetFieldValues
 *       lose_after_calls N    after N device calls every call returns GPU_IS_LOST (-1 = never)
 *       lose_after_ms N       the same, N ms after the first nvmlInit (-1 = never)
 *       lost 0|1              lose the GPU now (1) or bring it back (0)
 *       field_rules_from_ms N field:ID rules apply only from N ms after the first nvmlInit
 *       field_rules_until_ms N  ... and until N ms after it (default: always; a metric that
 *                             fails for a while mid-run)
 *       field_rules_from_call N   field:ID rules apply only from this device's Nth
 *       field_rules_until_call N  nvmlDeviceGetFieldValues call (0-based) until before the Nth:
 *                             a window in samples, not time, so a loaded machine that starts
 *                             sampling late still meets it (default -1: no such window)
 *       energy_mode fixed|dynamic   dynamic: the counter integrates the instant power over
 *                             CLOCK_MONOTONIC time and publishes every energy_update_ms
 *       energy_update_ms N    publication period of the dynamic counter (default 50; 0 = always)
 *       power_square_mw N     instant power alternates: power_instant_mw for the first half
 *       power_period_ms N     of each period, N for the second half (-1 = off)
 *       samples_period_us N   nvmlDeviceGetSamples: the driver's buffer takes a sample every N us
 *                             of CLOCK_MONOTONIC since the device's t0 (default 20000; 0 = the
 *                             call returns NOT_SUPPORTED). Total power is the instant power at
 *                             that time (square wave included), in mW; SM clock and GPU
 *                             utilization are clock_sm_mhz / util_gpu_pct; timestamps are wall-
 *                             clock us, as the real driver's
 *       samples_buffer N      samples the driver's buffer holds (default 100): older ones are gone
 *     Entry-point errors (VALUE = an error name, or OK to clear):
 *       fn:NAME ERR           the named function returns ERR (e.g. fn:nvmlDeviceGetCurrent
 *                             ClocksEventReasons FUNCTION_NOT_FOUND, as if it were missing)
 *       field:ID[:SCOPE] ERR  that field (any scope, or that scopeId) reports ERR in its
 *                             nvmlReturn while the others succeed
 *       ftype:ID TYPE         report field ID with valueType TYPE (DOUBLE, UINT, ULONG, ULL,
 *                             SLL, SINT, USHORT or 0..6), to exercise a caller's decoding
 *
 *   Error names: NVML_ERROR_ suffixes (NOT_SUPPORTED, GPU_IS_LOST, FUNCTION_NOT_FOUND,
 *   NO_PERMISSION, UNKNOWN, DRIVER_NOT_LOADED, ...) or ERR:<number>.
 *
 *   Example:
 *     device_count 2
 *     * call_delay_us 20
 *     0 power_instant_mw 250000
 *     0 temp_gpu_c NOT_SUPPORTED
 *     1 energy_mode dynamic
 *     1 fn:nvmlDeviceGetCurrentClocksEventReasons FUNCTION_NOT_FOUND
 *
 * Test hooks (ctypes): fake_nvml_command(line), fake_nvml_load_script(path),
 * fake_nvml_reset(), fake_nvml_call_count(name), fake_nvml_field_count(field_id),
 * fake_nvml_reset_counts(), fake_nvml_is_fake().
 * ---------------------------------------------------------------------------------------
 */

#define _GNU_SOURCE
#include <ctype.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

/* ---- the real library's struct layouts ------------------------------------------------ */

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;   /* us since the epoch */
    long long latencyUsec;
    int valueType;         /* nvmlValueType_t */
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned long long referenceTime; /* us */
    unsigned long long violationTime; /* ns */
} nvmlViolationTime_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version;
    int sensorType;
    int temperature;
} nvmlTemperature_t;

typedef struct {
    unsigned int isC2cEnabled;
} nvmlC2cModeInfo_v1_t;

typedef struct {
    unsigned long long timeStamp; /* CPU wall clock, us */
    nvmlValue_t sampleValue;
} nvmlSample_t;

_Static_assert(sizeof(nvmlSample_t) == 16, "nvmlSample_t must be 16 bytes");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t must be 40 bytes");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t must be 40 bytes");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t must be 68 bytes");
_Static_assert(sizeof(nvmlTemperature_t) == 12, "nvmlTemperature_t must be 12 bytes");
_Static_assert(sizeof(nvmlViolationTime_t) == 16, "nvmlViolationTime_t must be 16 bytes");

#define NVML_MEMORY_V2_VERSION 0x02000028u
#define NVML_TEMPERATURE_V1_VERSION 0x0100000Cu
#define NVML_C2C_MODE_INFO_V1_VERSION 0x01000008u

enum { VT_DOUBLE = 0, VT_UINT = 1, VT_ULONG = 2, VT_ULL = 3, VT_SLL = 4, VT_SINT = 5, VT_USHORT = 6 };

/* ---- quantities ------------------------------------------------------------------------ */

#define QUANTITIES(X)                                   \
    X(POWER_INSTANT, "power_instant_mw", 250000)        \
    X(POWER_AVERAGE, "power_average_mw", 245000)        \
    X(POWER_MEMORY, "power_memory_mw", 40000)           \
    X(POWER_MODULE_EXTRA, "power_module_extra_mw", 0)   \
    X(ENERGY, "energy_mj", 1000000000ULL)               \
    X(TEMP_GPU, "temp_gpu_c", 55)                       \
    X(TEMP_GPU_MAX, "temp_gpu_max_c", 63)               \
    X(TEMP_MEMORY, "temp_memory_c", 48)                 \
    X(CLOCK_SM, "clock_sm_mhz", 1980)                   \
    X(CLOCK_MEM, "clock_mem_mhz", 2619)                 \
    X(CLOCK_GRAPHICS, "clock_graphics_mhz", 1980)       \
    X(CLOCK_SM_MAX, "clock_sm_max_mhz", 1980)           \
    X(CLOCK_MEM_MAX, "clock_mem_max_mhz", 2619)         \
    X(CLOCK_GRAPHICS_MAX, "clock_graphics_max_mhz", 1980) \
    X(CLOCKS_EVENT_REASONS, "clocks_event_reasons", 0)  \
    X(VIOL_POWER, "violation_power_ns", 123456789)      \
    X(VIOL_THERMAL, "violation_thermal_ns", 5000)       \
    X(VIOL_SYNC_BOOST, "violation_sync_boost_ns", 1001) \
    X(VIOL_BOARD_LIMIT, "violation_board_limit_ns", 1002) \
    X(VIOL_LOW_UTIL, "violation_low_util_ns", 1003)     \
    X(VIOL_RELIABILITY, "violation_reliability_ns", 1004) \
    X(VIOL_TOTAL_APP, "violation_total_app_clocks_ns", 1005) \
    X(VIOL_TOTAL_BASE, "violation_total_base_clocks_ns", 1006) \
    X(VIOL_SW_THERMAL, "violation_sw_thermal_ns", 1007) \
    X(VIOL_HW_THERMAL, "violation_hw_thermal_ns", 1008) \
    X(VIOL_HW_POWER_BRAKE, "violation_hw_power_brake_ns", 1009) \
    X(VIOL_TS, "violation_ts_us", 0)                    \
    X(PWR_SMOOTHING_ENABLED, "power_smoothing_enabled", 0) \
    X(PWR_SMOOTHING_PROFILE, "power_smoothing_profile", 0) \
    X(WORKLOAD_REQUESTED, "workload_profiles_requested", 0) \
    X(WORKLOAD_ENFORCED, "workload_profiles_enforced", 0) \
    X(UTIL_GPU, "util_gpu_pct", 97)                     \
    X(UTIL_MEM, "util_mem_pct", 45)                     \
    X(MEM_TOTAL, "mem_total_bytes", 150754820096ULL)    \
    X(MEM_USED, "mem_used_bytes", 42949672960ULL)       \
    X(MEM_RESERVED, "mem_reserved_bytes", 536870912ULL) \
    X(POWER_LIMIT, "power_limit_mw", 700000)            \
    X(POWER_MGMT_LIMIT, "power_management_limit_mw", 700000) \
    X(POWER_DEFAULT_LIMIT, "power_default_limit_mw", 700000) \
    X(POWER_MIN_LIMIT, "power_min_limit_mw", 200000)    \
    X(POWER_MAX_LIMIT, "power_max_limit_mw", 700000)    \
    X(PCIE_TX, "pcie_tx_bytes", 5000000000ULL)          \
    X(PCIE_RX, "pcie_rx_bytes", 6000000000ULL)          \
    X(NVLINK_TX, "nvlink_tx_kib", 9000000000ULL)        \
    X(NVLINK_RX, "nvlink_rx_kib", 8000000000ULL)        \
    X(NVLINK_LINKS, "nvlink_links", 18)                 \
    X(ARCHITECTURE, "architecture", 9)                  \
    X(CUDA_CC_MAJOR, "cuda_cc_major", 9)                \
    X(CUDA_CC_MINOR, "cuda_cc_minor", 0)                \
    X(C2C_ENABLED, "c2c_enabled", 0)

#define AS_ENUM(id, name, def) Q_##id,
enum { QUANTITIES(AS_ENUM) Q_COUNT };
#define AS_NAME(id, name, def) name,
static const char *const q_names[Q_COUNT] = {QUANTITIES(AS_NAME)};
#define AS_DEFAULT(id, name, def) (unsigned long long)(def),
static const unsigned long long q_defaults[Q_COUNT] = {QUANTITIES(AS_DEFAULT)};

/* ---- entry points (for call counters and fn: errors) ---------------------------------- */

#define FUNCTIONS(X)                                  \
    X(nvmlInit)                                       \
    X(nvmlInit_v2)                                    \
    X(nvmlInitWithFlags)                              \
    X(nvmlShutdown)                                   \
    X(nvmlErrorString)                                \
    X(nvmlSystemGetDriverVersion)                     \
    X(nvmlSystemGetNVMLVersion)                       \
    X(nvmlSystemGetCudaDriverVersion)                 \
    X(nvmlSystemGetCudaDriverVersion_v2)              \
    X(nvmlDeviceGetCount)                             \
    X(nvmlDeviceGetCount_v2)                          \
    X(nvmlDeviceGetHandleByIndex)                     \
    X(nvmlDeviceGetHandleByIndex_v2)                  \
    X(nvmlDeviceGetIndex)                             \
    X(nvmlDeviceGetUUID)                              \
    X(nvmlDeviceGetName)                              \
    X(nvmlDeviceGetPciInfo_v3)                        \
    X(nvmlDeviceGetPowerUsage)                        \
    X(nvmlDeviceGetTotalEnergyConsumption)            \
    X(nvmlDeviceGetTemperature)                       \
    X(nvmlDeviceGetTemperatureV)                      \
    X(nvmlDeviceGetClockInfo)                         \
    X(nvmlDeviceGetMaxClockInfo)                      \
    X(nvmlDeviceGetCurrentClocksEventReasons)         \
    X(nvmlDeviceGetCurrentClocksThrottleReasons)      \
    X(nvmlDeviceGetFieldValues)                       \
    X(nvmlDeviceGetViolationStatus)                   \
    X(nvmlDeviceWorkloadPowerProfileGetCurrentProfiles) \
    X(nvmlDeviceGetUtilizationRates)                  \
    X(nvmlDeviceGetMemoryInfo)                        \
    X(nvmlDeviceGetMemoryInfo_v2)                     \
    X(nvmlDeviceGetEnforcedPowerLimit)                \
    X(nvmlDeviceGetPowerManagementLimit)              \
    X(nvmlDeviceGetPowerManagementDefaultLimit)       \
    X(nvmlDeviceGetPowerManagementLimitConstraints)   \
    X(nvmlDeviceGetArchitecture)                      \
    X(nvmlDeviceGetCudaComputeCapability)             \
    X(nvmlDeviceGetC2cModeInfoV)                      \
    X(nvmlDeviceGetSamples)

#define FN_ENUM(name) F_##name,
enum { FUNCTIONS(FN_ENUM) F_COUNT };
#define FN_NAME(name) #name,
static const char *const fn_names[F_COUNT] = {FUNCTIONS(FN_NAME)};

/* ---- state ----------------------------------------------------------------------------- */

#define MAX_DEVICES 16
#define MAX_FIELD_RULES 64
#define MAX_FIELD_ID 1024
#define SCOPE_ANY 0x1FFFFFFFFULL /* wider than any scopeId */

typedef struct {
    unsigned int field_id;
    unsigned long long scope; /* SCOPE_ANY or a scopeId */
    nvmlReturn_t err;
} field_rule_t;

typedef struct {
    unsigned int field_id;
    int value_type;
} ftype_rule_t;

typedef struct fake_device {
    unsigned int index;
    char name[96];
    char uuid[96];
    char pci_bus_id[32];
    unsigned long long q[Q_COUNT];
    nvmlReturn_t q_err[Q_COUNT];
    nvmlReturn_t fn_err[F_COUNT];
    field_rule_t field_rules[MAX_FIELD_RULES];
    int n_field_rules;
    ftype_rule_t ftype_rules[MAX_FIELD_RULES];
    int n_ftype_rules;
    long long call_delay_us;
    long long field_delay_us;
    long long lose_after_calls; /* -1 = never */
    long long lose_after_ms;    /* -1 = never */
    long long rules_from_ms;    /* field rules apply from .. until (ms after the first init) */
    long long rules_until_ms;   /* -1 = always */
    long long rules_from_call;  /* field rules apply from this GetFieldValues call (-1: off) .. */
    long long rules_until_call; /* .. until before this one (-1: no end) */
    long long fv_calls;         /* nvmlDeviceGetFieldValues calls on this device so far */
    long long calls;
    int lost;
    /* dynamic energy: exact energy `acc` (mW*ns) up to `acc_t`; `reported` (mW*ns) as
       published at grid point `last_grid`; the grid starts at t0. */
    int energy_dynamic;
    long long energy_update_ms;
    long long square_mw;       /* -1 = off */
    long long square_period_ms;
    long long samples_period_us; /* nvmlDeviceGetSamples: 0 = not supported */
    long long samples_buffer;
    long long samples_wall_offset_us; /* wall us = mono ns / 1000 + this, fixed at reset */
    long long t0;
    unsigned __int128 acc;
    long long acc_t;
    unsigned __int128 reported;
    long long last_grid;
} fake_device;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static fake_device g_dev[MAX_DEVICES];
static unsigned int g_count = 1;
static int g_refcount = 0;
static int g_script_loaded = 0;
static long long g_first_init_ns = -1;
static nvmlReturn_t g_init_error = NVML_SUCCESS;
static char g_driver_version[80];
static char g_nvml_version[80];
static int g_cuda_driver_version = 12040;
static unsigned long long g_fn_calls[F_COUNT];
static unsigned long long g_field_calls[MAX_FIELD_ID];

static long long mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long long wall_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static void busy_wait_us(long long us) {
    if (us <= 0) return;
    long long end = mono_ns() + us * 1000LL;
    while (mono_ns() < end) {
    }
}

static void device_defaults(fake_device *d, unsigned int index, long long now) {
    memset(d, 0, sizeof(*d));
    d->index = index;
    snprintf(d->name, sizeof d->name, "NVIDIA H200 (fake NVML)");
    snprintf(d->uuid, sizeof d->uuid, "GPU-fa4e0000-0000-4000-8000-%012x", index);
    snprintf(d->pci_bus_id, sizeof d->pci_bus_id, "00000000:%02X:00.0", 0x18 + index);
    for (int i = 0; i < Q_COUNT; i++) d->q[i] = q_defaults[i];
    d->q_err[Q_C2C_ENABLED] = NVML_ERROR_NOT_SUPPORTED;
    d->q_err[Q_POWER_MODULE_EXTRA] = NVML_ERROR_NOT_SUPPORTED;
    d->q_err[Q_PWR_SMOOTHING_ENABLED] = NVML_ERROR_NOT_SUPPORTED;
    d->q_err[Q_PWR_SMOOTHING_PROFILE] = NVML_ERROR_NOT_SUPPORTED;
    d->q_err[Q_WORKLOAD_REQUESTED] = NVML_ERROR_NOT_SUPPORTED;
    d->lose_after_calls = -1;
    d->lose_after_ms = -1;
    d->rules_from_ms = 0;
    d->rules_until_ms = -1;
    d->rules_from_call = -1;
    d->rules_until_call = -1;
    d->fv_calls = 0;
    d->energy_update_ms = 50;
    d->square_mw = -1;
    d->square_period_ms = 100;
    d->samples_period_us = 20000;
    d->samples_buffer = 100;
    d->samples_wall_offset_us = wall_us() - now / 1000;
    d->t0 = now;
    d->acc_t = now;
    d->last_grid = now;
}

static void reset_all_locked(void) {
    long long now = mono_ns();
    for (unsigned int i = 0; i < MAX_DEVICES; i++) device_defaults(&g_dev[i], i, now);
    g_count = 1;
    g_refcount = 0;
    g_script_loaded = 0;
    g_first_init_ns = -1;
    g_init_error = NVML_SUCCESS;
    snprintf(g_driver_version, sizeof g_driver_version, "550.54.15");
    snprintf(g_nvml_version, sizeof g_nvml_version, "12.550.54.15");
    g_cuda_driver_version = 12040;
    for (int i = 0; i < F_COUNT; i++) __atomic_store_n(&g_fn_calls[i], 0, __ATOMIC_RELAXED);
    for (int i = 0; i < MAX_FIELD_ID; i++) __atomic_store_n(&g_field_calls[i], 0, __ATOMIC_RELAXED);
}

__attribute__((constructor)) static void fake_nvml_on_load(void) {
    pthread_mutex_lock(&g_lock);
    reset_all_locked();
    pthread_mutex_unlock(&g_lock);
}

/* ---- power and the dynamic energy counter ---------------------------------------------- */

/* Energy (mW*ns) from t0 to t0 + t under the current power program. */
static unsigned __int128 energy_from_t0(const fake_device *d, long long t) {
    unsigned long long base = d->q[Q_POWER_INSTANT];
    if (t <= 0) return 0;
    if (d->square_mw < 0 || d->square_period_ms <= 0) return (unsigned __int128)base * (unsigned long long)t;
    unsigned long long alt = (unsigned long long)d->square_mw;
    long long period = d->square_period_ms * 1000000LL;
    long long half = period / 2;
    long long full = t / period;
    long long rem = t % period;
    unsigned __int128 e = (unsigned __int128)(base * (unsigned long long)half) * (unsigned long long)full;
    e += (unsigned __int128)(alt * (unsigned long long)(period - half)) * (unsigned long long)full;
    if (rem < half) {
        e += (unsigned __int128)base * (unsigned long long)rem;
    } else {
        e += (unsigned __int128)base * (unsigned long long)half;
        e += (unsigned __int128)alt * (unsigned long long)(rem - half);
    }
    return e;
}

static unsigned __int128 energy_between(const fake_device *d, long long a, long long b) {
    if (b <= a) return 0;
    return energy_from_t0(d, b - d->t0) - energy_from_t0(d, a - d->t0);
}

static unsigned long long power_instant_at(const fake_device *d, long long now) {
    if (d->square_mw < 0 || d->square_period_ms <= 0) return d->q[Q_POWER_INSTANT];
    long long period = d->square_period_ms * 1000000LL;
    long long rem = (now - d->t0) % period;
    return rem < period / 2 ? d->q[Q_POWER_INSTANT] : (unsigned long long)d->square_mw;
}

static long long grid_at(const fake_device *d, long long now) {
    if (d->energy_update_ms <= 0) return now;
    long long period = d->energy_update_ms * 1000000LL;
    return d->t0 + ((now - d->t0) / period) * period;
}

static void energy_publish(fake_device *d, long long now) {
    long long g = grid_at(d, now);
    if (g > d->last_grid) {
        d->reported = d->acc + energy_between(d, d->acc_t, g);
        d->last_grid = g;
    }
}

/* Called before anything that changes the power program, so the past keeps its power. */
static void energy_settle(fake_device *d) {
    if (!d->energy_dynamic) return;
    long long now = mono_ns();
    energy_publish(d, now);
    d->acc += energy_between(d, d->acc_t, now);
    d->acc_t = now;
}

static void energy_restart(fake_device *d) {
    long long now = mono_ns();
    d->t0 = now;
    d->acc = 0;
    d->acc_t = now;
    d->reported = 0;
    d->last_grid = now;
}

static unsigned long long energy_now(fake_device *d) {
    if (!d->energy_dynamic) return d->q[Q_ENERGY];
    energy_publish(d, mono_ns());
    return d->q[Q_ENERGY] + (unsigned long long)(d->reported / 1000000000ULL);
}

/* ---- common entry logic ---------------------------------------------------------------- */

static void count_call(int fid) { __atomic_add_fetch(&g_fn_calls[fid], 1, __ATOMIC_RELAXED); }

/* Checks init and the handle, applies the delay and the loss triggers; on success returns
   with g_lock held and *out set. */
static nvmlReturn_t enter_device_uncounted(int fid, void *handle, fake_device **out) {
    pthread_mutex_lock(&g_lock);
    if (g_refcount <= 0) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    fake_device *d = (fake_device *)handle;
    if (d < &g_dev[0] || d >= &g_dev[g_count] || ((char *)d - (char *)&g_dev[0]) % sizeof(fake_device)) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    long long delay = d->call_delay_us;
    pthread_mutex_unlock(&g_lock);
    busy_wait_us(delay); /* outside the lock: concurrent callers overlap like on hardware */
    pthread_mutex_lock(&g_lock);
    d->calls++;
    if (d->lose_after_calls >= 0 && d->calls > d->lose_after_calls) d->lost = 1;
    if (d->lose_after_ms >= 0 && g_first_init_ns >= 0 &&
        mono_ns() - g_first_init_ns >= d->lose_after_ms * 1000000LL)
        d->lost = 1;
    if (d->lost) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_GPU_IS_LOST;
    }
    if (d->fn_err[fid]) {
        nvmlReturn_t e = d->fn_err[fid];
        pthread_mutex_unlock(&g_lock);
        return e;
    }
    *out = d;
    return NVML_SUCCESS;
}

static nvmlReturn_t enter_device(int fid, void *handle, fake_device **out) {
    count_call(fid);
    return enter_device_uncounted(fid, handle, out);
}

static nvmlReturn_t leave(nvmlReturn_t r) {
    pthread_mutex_unlock(&g_lock);
    return r;
}

static nvmlReturn_t enter_system(int fid) {
    count_call(fid);
    pthread_mutex_lock(&g_lock);
    if (g_refcount <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    return NVML_SUCCESS; /* lock held */
}

static nvmlReturn_t copy_string(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if (len < n + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

/* ---- script parsing -------------------------------------------------------------------- */

static const struct {
    const char *name;
    int code;
} err_names[] = {
    {"OK", 0}, {"SUCCESS", 0}, {"UNINITIALIZED", 1}, {"INVALID_ARGUMENT", 2},
    {"NOT_SUPPORTED", 3}, {"NO_PERMISSION", 4}, {"ALREADY_INITIALIZED", 5}, {"NOT_FOUND", 6},
    {"INSUFFICIENT_SIZE", 7}, {"INSUFFICIENT_POWER", 8}, {"DRIVER_NOT_LOADED", 9},
    {"TIMEOUT", 10}, {"IRQ_ISSUE", 11}, {"LIBRARY_NOT_FOUND", 12}, {"FUNCTION_NOT_FOUND", 13},
    {"CORRUPTED_INFOROM", 14}, {"GPU_IS_LOST", 15}, {"RESET_REQUIRED", 16},
    {"OPERATING_SYSTEM", 17}, {"LIB_RM_VERSION_MISMATCH", 18}, {"IN_USE", 19}, {"MEMORY", 20},
    {"NO_DATA", 21}, {"ARGUMENT_VERSION_MISMATCH", 25}, {"UNKNOWN", 999},
};

/* Returns 1 and sets *code if s names an error (or OK); 0 otherwise. */
static int parse_error(const char *s, int *code) {
    if (strncasecmp(s, "NVML_ERROR_", 11) == 0) s += 11;
    if (strncasecmp(s, "ERR:", 4) == 0) {
        char *end;
        long v = strtol(s + 4, &end, 0);
        if (*end) return 0;
        *code = (int)v;
        return 1;
    }
    for (size_t i = 0; i < sizeof err_names / sizeof err_names[0]; i++) {
        if (strcasecmp(s, err_names[i].name) == 0) {
            *code = err_names[i].code;
            return 1;
        }
    }
    return 0;
}

static int parse_value_type(const char *s, int *vt) {
    static const char *const names[] = {"DOUBLE", "UINT", "ULONG", "ULL", "SLL", "SINT", "USHORT"};
    for (int i = 0; i < 7; i++) {
        if (strcasecmp(s, names[i]) == 0) {
            *vt = i;
            return 1;
        }
    }
    char *end;
    long v = strtol(s, &end, 0);
    if (*s && !*end && v >= 0 && v <= 6) {
        *vt = (int)v;
        return 1;
    }
    return 0;
}

static int parse_ll(const char *s, long long *out) {
    char *end;
    if (!*s) return 0;
    long long v = strtoll(s, &end, 0);
    if (*end) return 0;
    *out = v;
    return 1;
}

static int parse_ull(const char *s, unsigned long long *out) {
    char *end;
    if (!*s || *s == '-') return 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (*end) return 0;
    *out = v;
    return 1;
}

static int find_fn(const char *name) {
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(fn_names[i], name) == 0) return i;
    return -1;
}

static int find_q(const char *name) {
    for (int i = 0; i < Q_COUNT; i++)
        if (strcmp(q_names[i], name) == 0) return i;
    return -1;
}

static int is_power_key(int q) { return q == Q_POWER_INSTANT || q == Q_ENERGY; }

/* Applies KEY VALUE to one device; lock held. Returns 0 or -1. */
static int apply_device(fake_device *d, const char *key, const char *value) {
    int code;
    long long v;
    int q = find_q(key);
    if (q >= 0) {
        unsigned long long u;
        if (parse_error(value, &code)) {
            d->q_err[q] = code;
            return 0;
        }
        if (!parse_ull(value, &u)) return -1;
        if (is_power_key(q)) energy_settle(d);
        d->q[q] = u;
        d->q_err[q] = 0;
        if (q == Q_ENERGY && d->energy_dynamic) energy_restart(d);
        return 0;
    }
    if (strcmp(key, "name") == 0) return snprintf(d->name, sizeof d->name, "%s", value), 0;
    if (strcmp(key, "uuid") == 0) return snprintf(d->uuid, sizeof d->uuid, "%s", value), 0;
    if (strcmp(key, "pci_bus_id") == 0)
        return snprintf(d->pci_bus_id, sizeof d->pci_bus_id, "%s", value), 0;
    if (strcmp(key, "energy_mode") == 0) {
        if (strcmp(value, "dynamic") == 0) {
            if (!d->energy_dynamic) {
                d->energy_dynamic = 1;
                energy_restart(d);
            }
        } else if (strcmp(value, "fixed") == 0) {
            if (d->energy_dynamic) d->q[Q_ENERGY] = energy_now(d);
            d->energy_dynamic = 0;
        } else {
            return -1;
        }
        return 0;
    }
    if (!strncmp(key, "fn:", 3)) {
        int f = find_fn(key + 3);
        if (f < 0 || !parse_error(value, &code)) return -1;
        d->fn_err[f] = code;
        return 0;
    }
    if (!strncmp(key, "field:", 6)) {
        char *end;
        unsigned long id = strtoul(key + 6, &end, 0);
        unsigned long long scope = SCOPE_ANY;
        if (*end == ':') scope = strtoull(end + 1, &end, 0);
        if (*end || !parse_error(value, &code)) return -1;
        for (int i = 0; i < d->n_field_rules; i++) {
            if (d->field_rules[i].field_id == id && d->field_rules[i].scope == scope) {
                d->field_rules[i].err = code;
                return 0;
            }
        }
        if (d->n_field_rules >= MAX_FIELD_RULES) return -1;
        d->field_rules[d->n_field_rules++] = (field_rule_t){(unsigned int)id, scope, code};
        return 0;
    }
    if (!strncmp(key, "ftype:", 6)) {
        char *end;
        unsigned long id = strtoul(key + 6, &end, 0);
        int vt;
        if (*end || !parse_value_type(value, &vt)) return -1;
        for (int i = 0; i < d->n_ftype_rules; i++) {
            if (d->ftype_rules[i].field_id == id) {
                d->ftype_rules[i].value_type = vt;
                return 0;
            }
        }
        if (d->n_ftype_rules >= MAX_FIELD_RULES) return -1;
        d->ftype_rules[d->n_ftype_rules++] = (ftype_rule_t){(unsigned int)id, vt};
        return 0;
    }
    if (!parse_ll(value, &v)) return -1;
    if (strcmp(key, "call_delay_us") == 0) d->call_delay_us = v;
    else if (strcmp(key, "field_delay_us") == 0) d->field_delay_us = v;
    else if (strcmp(key, "lose_after_calls") == 0) {
        d->lose_after_calls = v;
        d->calls = 0;
    } else if (strcmp(key, "lose_after_ms") == 0) d->lose_after_ms = v;
    else if (strcmp(key, "field_rules_from_ms") == 0) d->rules_from_ms = v;
    else if (strcmp(key, "field_rules_until_ms") == 0) d->rules_until_ms = v;
    else if (strcmp(key, "field_rules_from_call") == 0) d->rules_from_call = v;
    else if (strcmp(key, "field_rules_until_call") == 0) d->rules_until_call = v;
    else if (strcmp(key, "lost") == 0) d->lost = v != 0;
    else if (strcmp(key, "energy_update_ms") == 0) {
        energy_settle(d);
        d->energy_update_ms = v;
        d->last_grid = grid_at(d, mono_ns());
    } else if (strcmp(key, "power_square_mw") == 0) {
        energy_settle(d);
        d->square_mw = v;
    } else if (strcmp(key, "power_period_ms") == 0) {
        energy_settle(d);
        d->square_period_ms = v;
    } else if (strcmp(key, "samples_period_us") == 0) {
        if (v < 0) return -1;
        d->samples_period_us = v;
    } else if (strcmp(key, "samples_buffer") == 0) {
        if (v < 1) return -1;
        d->samples_buffer = v;
    } else return -1;
    return 0;
}

/* One script line; lock held. Returns 0 (also for blank lines) or -1. */
static int command_locked(const char *line_in) {
    char line[512];
    snprintf(line, sizeof line, "%s", line_in);
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *p = line;
    while (isspace((unsigned char)*p)) p++;
    char *e = p + strlen(p);
    while (e > p && isspace((unsigned char)e[-1])) *--e = 0;
    if (!*p) return 0;

    char *tok1 = p;
    while (*p && !isspace((unsigned char)*p)) p++;
    if (*p) *p++ = 0;
    while (isspace((unsigned char)*p)) p++;

    int is_device = strcmp(tok1, "*") == 0 || isdigit((unsigned char)tok1[0]);
    if (!is_device) {
        const char *value = p;
        long long v;
        int code;
        if (strcmp(tok1, "device_count") == 0) {
            if (!parse_ll(value, &v) || v < 0 || v > MAX_DEVICES) return -1;
            g_count = (unsigned int)v;
        } else if (strcmp(tok1, "driver_version") == 0) {
            snprintf(g_driver_version, sizeof g_driver_version, "%s", value);
        } else if (strcmp(tok1, "nvml_version") == 0) {
            snprintf(g_nvml_version, sizeof g_nvml_version, "%s", value);
        } else if (strcmp(tok1, "cuda_driver_version") == 0) {
            if (!parse_ll(value, &v)) return -1;
            g_cuda_driver_version = (int)v;
        } else if (strcmp(tok1, "init_error") == 0) {
            if (!parse_error(value, &code)) return -1;
            g_init_error = code;
        } else {
            return -1;
        }
        return 0;
    }

    char *key = p;
    while (*p && !isspace((unsigned char)*p)) p++;
    if (*p) *p++ = 0;
    while (isspace((unsigned char)*p)) p++;
    const char *value = p;
    if (!*key) return -1;

    if (strcmp(tok1, "*") == 0) {
        for (unsigned int i = 0; i < MAX_DEVICES; i++)
            if (apply_device(&g_dev[i], key, value)) return -1;
        return 0;
    }
    long long idx;
    if (!parse_ll(tok1, &idx) || idx < 0 || idx >= MAX_DEVICES) return -1;
    return apply_device(&g_dev[idx], key, value);
}

static int load_script_locked(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fake_nvml: cannot open FAKE_NVML_SCRIPT %s\n", path);
        return -1;
    }
    char line[512];
    int lineno = 0, bad = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (command_locked(line)) {
            fprintf(stderr, "fake_nvml: %s:%d: cannot parse: %s", path, lineno, line);
            bad++;
        }
    }
    fclose(f);
    return bad ? -1 : 0;
}

/* ---- test hooks ------------------------------------------------------------------------ */

EXPORT int fake_nvml_is_fake(void) { return 1; }

EXPORT int fake_nvml_command(const char *line) {
    pthread_mutex_lock(&g_lock);
    int r = command_locked(line);
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT int fake_nvml_load_script(const char *path) {
    pthread_mutex_lock(&g_lock);
    int r = load_script_locked(path);
    g_script_loaded = 1;
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Back to the state of a freshly loaded library: defaults, not initialized, counters zero.
   $FAKE_NVML_SCRIPT is read again at the next nvmlInit. */
EXPORT void fake_nvml_reset(void) {
    pthread_mutex_lock(&g_lock);
    reset_all_locked();
    pthread_mutex_unlock(&g_lock);
}

EXPORT void fake_nvml_reset_counts(void) {
    for (int i = 0; i < F_COUNT; i++) __atomic_store_n(&g_fn_calls[i], 0, __ATOMIC_RELAXED);
    for (int i = 0; i < MAX_FIELD_ID; i++) __atomic_store_n(&g_field_calls[i], 0, __ATOMIC_RELAXED);
}

/* Calls of an entry point by name since load/reset; (unsigned long long)-1 if unknown. */
EXPORT unsigned long long fake_nvml_call_count(const char *name) {
    int f = find_fn(name);
    if (f < 0) return ~0ULL;
    return __atomic_load_n(&g_fn_calls[f], __ATOMIC_RELAXED);
}

/* How many times a field id was requested through nvmlDeviceGetFieldValues. */
EXPORT unsigned long long fake_nvml_field_count(unsigned int field_id) {
    if (field_id >= MAX_FIELD_ID) return 0;
    return __atomic_load_n(&g_field_calls[field_id], __ATOMIC_RELAXED);
}

EXPORT int fake_nvml_refcount(void) {
    pthread_mutex_lock(&g_lock);
    int r = g_refcount;
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* ---- init / shutdown / system ---------------------------------------------------------- */

static nvmlReturn_t do_init(int fid) {
    count_call(fid);
    pthread_mutex_lock(&g_lock);
    if (!g_script_loaded) {
        g_script_loaded = 1;
        const char *path = getenv("FAKE_NVML_SCRIPT");
        if (path && *path) load_script_locked(path);
    }
    if (g_init_error) return leave(g_init_error);
    if (g_first_init_ns < 0) g_first_init_ns = mono_ns();
    g_refcount++;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlInit(void) { return do_init(F_nvmlInit); }
EXPORT nvmlReturn_t nvmlInit_v2(void) { return do_init(F_nvmlInit_v2); }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init(F_nvmlInitWithFlags);
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    count_call(F_nvmlShutdown);
    pthread_mutex_lock(&g_lock);
    if (g_refcount <= 0) return leave(NVML_ERROR_UNINITIALIZED);
    g_refcount--;
    return leave(NVML_SUCCESS);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    count_call(F_nvmlErrorString);
    switch (result) {
        case 0: return "Success";
        case 1: return "Uninitialized";
        case 2: return "Invalid Argument";
        case 3: return "Not Supported";
        case 4: return "Insufficient Permissions";
        case 5: return "Already Initialized";
        case 6: return "Not Found";
        case 7: return "Insufficient Size";
        case 8: return "Insufficient External Power";
        case 9: return "Driver Not Loaded";
        case 10: return "Timeout";
        case 11: return "Interrupt Request Issue";
        case 12: return "NVML Shared Library Not Found";
        case 13: return "Function Not Found";
        case 14: return "Corrupted infoROM";
        case 15: return "GPU is lost";
        case 16: return "GPU requires restart";
        case 17: return "The operating system has blocked the request.";
        case 18: return "RM has detected an NVML/RM version mismatch.";
        case 20: return "Insufficient Memory";
        case 25: return "Argument Version Mismatch";
        default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = enter_system(F_nvmlSystemGetDriverVersion);
    if (r) return r;
    return leave(copy_string(version, length, g_driver_version));
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t r = enter_system(F_nvmlSystemGetNVMLVersion);
    if (r) return r;
    return leave(copy_string(version, length, g_nvml_version));
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) {
    nvmlReturn_t r = enter_system(F_nvmlSystemGetCudaDriverVersion);
    if (r) return r;
    if (!v) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *v = g_cuda_driver_version;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    nvmlReturn_t r = enter_system(F_nvmlSystemGetCudaDriverVersion_v2);
    if (r) return r;
    if (!v) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *v = g_cuda_driver_version;
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t get_count(int fid, unsigned int *count) {
    nvmlReturn_t r = enter_system(fid);
    if (r) return r;
    if (!count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = g_count;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *c) { return get_count(F_nvmlDeviceGetCount, c); }
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *c) { return get_count(F_nvmlDeviceGetCount_v2, c); }

static nvmlReturn_t get_handle(int fid, unsigned int index, void **device) {
    nvmlReturn_t r = enter_system(fid);
    if (r) return r;
    if (!device || index >= g_count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (g_dev[index].lost) return leave(NVML_ERROR_GPU_IS_LOST);
    *device = &g_dev[index];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, void **d) {
    return get_handle(F_nvmlDeviceGetHandleByIndex, i, d);
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **d) {
    return get_handle(F_nvmlDeviceGetHandleByIndex_v2, i, d);
}

/* ---- device queries -------------------------------------------------------------------- */

#define ENTER(fid)                                    \
    fake_device *d = NULL;                            \
    nvmlReturn_t r_ = enter_device(F_##fid, device, &d); \
    if (r_) return r_

/* Value of a quantity, or its scripted error. */
#define QGET(qid, dst)                                   \
    do {                                                 \
        if (d->q_err[qid]) return leave(d->q_err[qid]); \
        (dst) = d->q[qid];                               \
    } while (0)

EXPORT nvmlReturn_t nvmlDeviceGetIndex(void *device, unsigned int *index) {
    ENTER(nvmlDeviceGetIndex);
    if (!index) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = d->index;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length) {
    ENTER(nvmlDeviceGetUUID);
    return leave(copy_string(uuid, length, d->uuid));
}

EXPORT nvmlReturn_t nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    ENTER(nvmlDeviceGetName);
    return leave(copy_string(name, length, d->name));
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(void *device, nvmlPciInfo_t *pci) {
    ENTER(nvmlDeviceGetPciInfo_v3);
    if (!pci) return leave(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    unsigned int dom = 0, bus = 0, dev = 0, fn = 0;
    sscanf(d->pci_bus_id, "%x:%x:%x.%x", &dom, &bus, &dev, &fn);
    pci->domain = dom;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = 0x233510DE;
    pci->pciSubSystemId = 0x18BE10DE;
    snprintf(pci->busId, sizeof pci->busId, "%s", d->pci_bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", dom, bus, dev, fn);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(void *device, unsigned int *power) {
    ENTER(nvmlDeviceGetPowerUsage);
    unsigned long long v;
    QGET(Q_POWER_AVERAGE, v);
    if (!power) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *power = (unsigned int)v;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(void *device, unsigned long long *energy) {
    ENTER(nvmlDeviceGetTotalEnergyConsumption);
    if (d->q_err[Q_ENERGY]) return leave(d->q_err[Q_ENERGY]);
    if (!energy) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *energy = energy_now(d);
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t temperature_of(fake_device *d, int sensor, unsigned long long *out) {
    int q = sensor == 0 ? Q_TEMP_GPU : sensor == 1 ? Q_TEMP_GPU_MAX : -1;
    if (q < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->q_err[q]) return d->q_err[q];
    *out = d->q[q];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(void *device, int sensorType, unsigned int *temp) {
    ENTER(nvmlDeviceGetTemperature);
    unsigned long long v = 0;
    nvmlReturn_t r = temperature_of(d, sensorType, &v);
    if (r) return leave(r);
    if (!temp) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *temp = (unsigned int)v;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(void *device, nvmlTemperature_t *temperature) {
    ENTER(nvmlDeviceGetTemperatureV);
    if (!temperature) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (temperature->version != NVML_TEMPERATURE_V1_VERSION) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long v = 0;
    nvmlReturn_t r = temperature_of(d, temperature->sensorType, &v);
    if (r) return leave(r);
    temperature->temperature = (int)v;
    return leave(NVML_SUCCESS);
}

static int clock_quantity(int type, int max) {
    switch (type) {
        case 0: return max ? Q_CLOCK_GRAPHICS_MAX : Q_CLOCK_GRAPHICS;
        case 1: return max ? Q_CLOCK_SM_MAX : Q_CLOCK_SM;
        case 2: return max ? Q_CLOCK_MEM_MAX : Q_CLOCK_MEM;
        default: return -1;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(void *device, int type, unsigned int *clock) {
    ENTER(nvmlDeviceGetClockInfo);
    int q = clock_quantity(type, 0);
    if (q < 0 || !clock) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long v;
    QGET(q, v);
    *clock = (unsigned int)v;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(void *device, int type, unsigned int *clock) {
    ENTER(nvmlDeviceGetMaxClockInfo);
    int q = clock_quantity(type, 1);
    if (q < 0 || !clock) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long v;
    QGET(q, v);
    *clock = (unsigned int)v;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(void *device, unsigned long long *reasons) {
    ENTER(nvmlDeviceGetCurrentClocksEventReasons);
    if (!reasons) return leave(NVML_ERROR_INVALID_ARGUMENT);
    QGET(Q_CLOCKS_EVENT_REASONS, *reasons);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(void *device, unsigned long long *reasons) {
    ENTER(nvmlDeviceGetCurrentClocksThrottleReasons);
    if (!reasons) return leave(NVML_ERROR_INVALID_ARGUMENT);
    QGET(Q_CLOCKS_EVENT_REASONS, *reasons);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetViolationStatus(void *device, int perfPolicyType, nvmlViolationTime_t *viol) {
    ENTER(nvmlDeviceGetViolationStatus);
    int q;
    switch (perfPolicyType) {
        case 0: q = Q_VIOL_POWER; break;
        case 1: q = Q_VIOL_THERMAL; break;
        case 2: q = Q_VIOL_SYNC_BOOST; break;
        case 3: q = Q_VIOL_BOARD_LIMIT; break;
        case 4: q = Q_VIOL_LOW_UTIL; break;
        case 5: q = Q_VIOL_RELIABILITY; break;
        case 10: q = Q_VIOL_TOTAL_APP; break;
        case 11: q = Q_VIOL_TOTAL_BASE; break;
        default: q = -1;
    }
    if (q < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    if (!viol) return leave(NVML_ERROR_INVALID_ARGUMENT);
    QGET(q, viol->violationTime);
    viol->referenceTime = d->q[Q_VIOL_TS] ? d->q[Q_VIOL_TS] : (unsigned long long)wall_us();
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(void *device, nvmlUtilization_t *util) {
    ENTER(nvmlDeviceGetUtilizationRates);
    if (!util) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long g, m;
    QGET(Q_UTIL_GPU, g);
    QGET(Q_UTIL_MEM, m);
    util->gpu = (unsigned int)g;
    util->memory = (unsigned int)m;
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t memory_numbers(fake_device *d, unsigned long long *total, unsigned long long *used,
                                   unsigned long long *reserved) {
    if (d->q_err[Q_MEM_TOTAL]) return d->q_err[Q_MEM_TOTAL];
    if (d->q_err[Q_MEM_USED]) return d->q_err[Q_MEM_USED];
    if (d->q_err[Q_MEM_RESERVED]) return d->q_err[Q_MEM_RESERVED];
    *total = d->q[Q_MEM_TOTAL];
    *used = d->q[Q_MEM_USED];
    *reserved = d->q[Q_MEM_RESERVED];
    if (*used + *reserved > *total) *used = *total - (*reserved > *total ? *total : *reserved);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *memory) {
    ENTER(nvmlDeviceGetMemoryInfo);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long total, used, reserved;
    nvmlReturn_t r = memory_numbers(d, &total, &used, &reserved);
    if (r) return leave(r);
    memory->total = total;
    memory->used = used + reserved; /* v1 counts the driver's reservation as used */
    memory->free = total - memory->used;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *memory) {
    ENTER(nvmlDeviceGetMemoryInfo_v2);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != NVML_MEMORY_V2_VERSION) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long total, used, reserved;
    nvmlReturn_t r = memory_numbers(d, &total, &used, &reserved);
    if (r) return leave(r);
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used;
    memory->free = total - used - reserved;
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t uint_quantity(int fid, void *device, int q, unsigned int *out) {
    fake_device *d = NULL;
    nvmlReturn_t r = enter_device(fid, device, &d);
    if (r) return r;
    if (!out) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (d->q_err[q]) return leave(d->q_err[q]);
    *out = (unsigned int)d->q[q];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(void *device, unsigned int *limit) {
    return uint_quantity(F_nvmlDeviceGetEnforcedPowerLimit, device, Q_POWER_LIMIT, limit);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(void *device, unsigned int *limit) {
    return uint_quantity(F_nvmlDeviceGetPowerManagementLimit, device, Q_POWER_MGMT_LIMIT, limit);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(void *device, unsigned int *limit) {
    return uint_quantity(F_nvmlDeviceGetPowerManagementDefaultLimit, device, Q_POWER_DEFAULT_LIMIT, limit);
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(void *device, unsigned int *arch) {
    return uint_quantity(F_nvmlDeviceGetArchitecture, device, Q_ARCHITECTURE, arch);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(void *device, unsigned int *minLimit,
                                                                 unsigned int *maxLimit) {
    ENTER(nvmlDeviceGetPowerManagementLimitConstraints);
    if (!minLimit || !maxLimit) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long lo, hi;
    QGET(Q_POWER_MIN_LIMIT, lo);
    QGET(Q_POWER_MAX_LIMIT, hi);
    *minLimit = (unsigned int)lo;
    *maxLimit = (unsigned int)hi;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(void *device, int *major, int *minor) {
    ENTER(nvmlDeviceGetCudaComputeCapability);
    if (!major || !minor) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long a, b;
    QGET(Q_CUDA_CC_MAJOR, a);
    QGET(Q_CUDA_CC_MINOR, b);
    *major = (int)a;
    *minor = (int)b;
    return leave(NVML_SUCCESS);
}

/* The driver's sample buffer: a sample every samples_period_us since t0, the newest
   samples_buffer of them kept. With samples NULL: *count = the buffer's size. Else the samples
   newer than lastSeenTimeStamp (wall us), oldest first, at most *count; none: NOT_FOUND. */
enum { SAMPLES_TOTAL_POWER = 0, SAMPLES_GPU_UTILIZATION = 1, SAMPLES_PROCESSOR_CLK = 5 };

EXPORT nvmlReturn_t nvmlDeviceGetSamples(void *device, int type, unsigned long long lastSeenTimeStamp,
                                         int *sampleValType, unsigned int *sampleCount, nvmlSample_t *samples) {
    ENTER(nvmlDeviceGetSamples);
    if (!sampleValType || !sampleCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    int q = type == SAMPLES_TOTAL_POWER ? Q_POWER_INSTANT
            : type == SAMPLES_GPU_UTILIZATION ? Q_UTIL_GPU
            : type == SAMPLES_PROCESSOR_CLK ? Q_CLOCK_SM : -1;
    if (q < 0 || d->samples_period_us <= 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    if (d->q_err[q]) return leave(d->q_err[q]);
    *sampleValType = VT_UINT;
    if (!samples) {
        *sampleCount = (unsigned int)d->samples_buffer;
        return leave(NVML_SUCCESS);
    }
    long long now = mono_ns();
    long long period = d->samples_period_us * 1000LL;
    long long newest = now >= d->t0 ? (now - d->t0) / period : -1;
    long long oldest = newest - d->samples_buffer + 1;
    if (oldest < 0) oldest = 0;
    unsigned int n = 0;
    for (long long k = oldest; k <= newest && n < *sampleCount; k++) {
        long long t = d->t0 + k * period;
        unsigned long long ts = (unsigned long long)(t / 1000 + d->samples_wall_offset_us);
        if (ts <= lastSeenTimeStamp) continue;
        samples[n].timeStamp = ts;
        samples[n].sampleValue.uiVal = (unsigned int)(q == Q_POWER_INSTANT ? power_instant_at(d, t) : d->q[q]);
        n++;
    }
    *sampleCount = n;
    return leave(n ? NVML_SUCCESS : 6 /* NVML_ERROR_NOT_FOUND */);
}

/* nvmlWorkloadPowerProfileCurrentProfiles_v1_t: version, then three 255-bit masks (8 u32 each). */
typedef struct {
    unsigned int version;
    unsigned int perfProfilesMask[8];
    unsigned int requestedProfilesMask[8];
    unsigned int enforcedProfilesMask[8];
} nvmlWorkloadPowerProfileCurrentProfiles_v1_t;
_Static_assert(sizeof(nvmlWorkloadPowerProfileCurrentProfiles_v1_t) == 100, "current profiles: 100 bytes");

EXPORT nvmlReturn_t nvmlDeviceWorkloadPowerProfileGetCurrentProfiles(
    void *device, nvmlWorkloadPowerProfileCurrentProfiles_v1_t *cur) {
    ENTER(nvmlDeviceWorkloadPowerProfileGetCurrentProfiles);
    if (!cur) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (cur->version != 0x1000064) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long requested, enforced;
    QGET(Q_WORKLOAD_REQUESTED, requested);
    QGET(Q_WORKLOAD_ENFORCED, enforced);
    memset(cur->perfProfilesMask, 0, sizeof cur->perfProfilesMask);
    memset(cur->requestedProfilesMask, 0, sizeof cur->requestedProfilesMask);
    memset(cur->enforcedProfilesMask, 0, sizeof cur->enforcedProfilesMask);
    cur->perfProfilesMask[0] = (unsigned int)(requested | enforced);
    cur->requestedProfilesMask[0] = (unsigned int)requested;
    cur->enforcedProfilesMask[0] = (unsigned int)enforced;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetC2cModeInfoV(void *device, nvmlC2cModeInfo_v1_t *info) {
    ENTER(nvmlDeviceGetC2cModeInfoV);
    if (!info) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long v;
    QGET(Q_C2C_ENABLED, v);
    info->isC2cEnabled = (unsigned int)v;
    return leave(NVML_SUCCESS);
}

/* ---- field values ---------------------------------------------------------------------- */

enum {
    FI_PERF_POLICY_POWER = 74,
    FI_PERF_POLICY_THERMAL = 75,
    FI_PERF_POLICY_SYNC_BOOST = 76,
    FI_PERF_POLICY_BOARD_LIMIT = 77,
    FI_PERF_POLICY_LOW_UTILIZATION = 78,
    FI_PERF_POLICY_RELIABILITY = 79,
    FI_PERF_POLICY_TOTAL_APP_CLOCKS = 80,
    FI_PERF_POLICY_TOTAL_BASE_CLOCKS = 81,
    FI_MEMORY_TEMP = 82,
    FI_TOTAL_ENERGY_CONSUMPTION = 83,
    FI_NVLINK_LINK_COUNT = 91,
    FI_NVLINK_THROUGHPUT_DATA_TX = 138,
    FI_NVLINK_THROUGHPUT_DATA_RX = 139,
    FI_POWER_AVERAGE = 185,
    FI_POWER_INSTANT = 186,
    FI_POWER_MIN_LIMIT = 187,
    FI_POWER_MAX_LIMIT = 188,
    FI_POWER_DEFAULT_LIMIT = 189,
    FI_POWER_CURRENT_LIMIT = 190,
    FI_ENERGY = 191,
    FI_PCIE_COUNT_TX_BYTES = 197,
    FI_PCIE_COUNT_RX_BYTES = 198,
    FI_PWR_SMOOTHING_ENABLED = 251,
    FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE = 264,
    FI_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN = 269,
    FI_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN = 270,
    FI_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN = 271,
};

/* The violation counters' fields: they report violation_ts_us as their timestamp when set. */
static int is_violation_field(unsigned int id) {
    return (id >= FI_PERF_POLICY_POWER && id <= FI_PERF_POLICY_TOTAL_BASE_CLOCKS) ||
           (id >= FI_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN && id <= FI_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN);
}

enum { SCOPE_GPU = 0, SCOPE_MODULE = 1, SCOPE_MEMORY = 2 };

static nvmlReturn_t qval(fake_device *d, int q, unsigned long long *out) {
    if (d->q_err[q]) return d->q_err[q];
    *out = d->q[q];
    return NVML_SUCCESS;
}

/* One field's value and natural type; lock held. */
static nvmlReturn_t field_value(fake_device *d, unsigned int id, unsigned int scope, long long now,
                                unsigned long long *out, int *vt) {
    *vt = VT_UINT;
    switch (id) {
        case FI_POWER_INSTANT:
            if (scope == SCOPE_MODULE && d->q_err[Q_POWER_MODULE_EXTRA]) return d->q_err[Q_POWER_MODULE_EXTRA];
            if (scope == SCOPE_GPU || scope == SCOPE_MODULE) {
                if (d->q_err[Q_POWER_INSTANT]) return d->q_err[Q_POWER_INSTANT];
                *out = power_instant_at(d, now) + (scope == SCOPE_MODULE ? d->q[Q_POWER_MODULE_EXTRA] : 0);
                return NVML_SUCCESS;
            }
            if (scope == SCOPE_MEMORY) return qval(d, Q_POWER_MEMORY, out);
            return NVML_ERROR_NOT_SUPPORTED;
        case FI_POWER_AVERAGE:
            if (scope == SCOPE_MODULE && d->q_err[Q_POWER_MODULE_EXTRA]) return d->q_err[Q_POWER_MODULE_EXTRA];
            if (scope == SCOPE_GPU || scope == SCOPE_MODULE) {
                nvmlReturn_t rc = qval(d, Q_POWER_AVERAGE, out);
                if (!rc && scope == SCOPE_MODULE) *out += d->q[Q_POWER_MODULE_EXTRA];
                return rc;
            }
            if (scope == SCOPE_MEMORY) return qval(d, Q_POWER_MEMORY, out);
            return NVML_ERROR_NOT_SUPPORTED;
        case FI_TOTAL_ENERGY_CONSUMPTION:
        case FI_ENERGY:
            *vt = VT_ULL;
            if (d->q_err[Q_ENERGY]) return d->q_err[Q_ENERGY];
            *out = energy_now(d);
            return NVML_SUCCESS;
        case FI_MEMORY_TEMP: return qval(d, Q_TEMP_MEMORY, out);
        case FI_PERF_POLICY_POWER: *vt = VT_ULL; return qval(d, Q_VIOL_POWER, out);
        case FI_PERF_POLICY_THERMAL: *vt = VT_ULL; return qval(d, Q_VIOL_THERMAL, out);
        case FI_PERF_POLICY_SYNC_BOOST: *vt = VT_ULL; return qval(d, Q_VIOL_SYNC_BOOST, out);
        case FI_PERF_POLICY_BOARD_LIMIT: *vt = VT_ULL; return qval(d, Q_VIOL_BOARD_LIMIT, out);
        case FI_PERF_POLICY_LOW_UTILIZATION: *vt = VT_ULL; return qval(d, Q_VIOL_LOW_UTIL, out);
        case FI_PERF_POLICY_RELIABILITY: *vt = VT_ULL; return qval(d, Q_VIOL_RELIABILITY, out);
        case FI_PERF_POLICY_TOTAL_APP_CLOCKS: *vt = VT_ULL; return qval(d, Q_VIOL_TOTAL_APP, out);
        case FI_PERF_POLICY_TOTAL_BASE_CLOCKS: *vt = VT_ULL; return qval(d, Q_VIOL_TOTAL_BASE, out);
        case FI_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN: *vt = VT_ULL; return qval(d, Q_VIOL_SW_THERMAL, out);
        case FI_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN: *vt = VT_ULL; return qval(d, Q_VIOL_HW_THERMAL, out);
        case FI_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN: *vt = VT_ULL; return qval(d, Q_VIOL_HW_POWER_BRAKE, out);
        case FI_PWR_SMOOTHING_ENABLED: return qval(d, Q_PWR_SMOOTHING_ENABLED, out);
        case FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE: return qval(d, Q_PWR_SMOOTHING_PROFILE, out);
        case FI_PCIE_COUNT_TX_BYTES: *vt = VT_ULL; return qval(d, Q_PCIE_TX, out);
        case FI_PCIE_COUNT_RX_BYTES: *vt = VT_ULL; return qval(d, Q_PCIE_RX, out);
        case FI_NVLINK_LINK_COUNT: return qval(d, Q_NVLINK_LINKS, out);
        case FI_NVLINK_THROUGHPUT_DATA_TX:
        case FI_NVLINK_THROUGHPUT_DATA_RX: {
            *vt = VT_ULL;
            int q = id == FI_NVLINK_THROUGHPUT_DATA_TX ? Q_NVLINK_TX : Q_NVLINK_RX;
            unsigned long long total, links = d->q[Q_NVLINK_LINKS];
            nvmlReturn_t r = qval(d, q, &total);
            if (r) return r;
            if (links == 0) return NVML_ERROR_NOT_SUPPORTED;
            if (scope == UINT_MAX) {
                *out = total;
                return NVML_SUCCESS;
            }
            if (scope >= links) return NVML_ERROR_INVALID_ARGUMENT;
            *out = total / links + (scope == 0 ? total % links : 0);
            return NVML_SUCCESS;
        }
        case FI_POWER_MIN_LIMIT: return qval(d, Q_POWER_MIN_LIMIT, out);
        case FI_POWER_MAX_LIMIT: return qval(d, Q_POWER_MAX_LIMIT, out);
        case FI_POWER_DEFAULT_LIMIT: return qval(d, Q_POWER_DEFAULT_LIMIT, out);
        case FI_POWER_CURRENT_LIMIT: return qval(d, Q_POWER_MGMT_LIMIT, out);
        default: return NVML_ERROR_NOT_SUPPORTED;
    }
}

/* A scripted error for (field, scope): a rule for that exact scope wins over an any-scope one. */
static nvmlReturn_t field_rule_error(const fake_device *d, unsigned int id, unsigned int scope) {
    nvmlReturn_t any = NVML_SUCCESS;
    if (g_first_init_ns >= 0) {
        long long ms = (mono_ns() - g_first_init_ns) / 1000000LL;
        if (ms < d->rules_from_ms || (d->rules_until_ms >= 0 && ms >= d->rules_until_ms)) return any;
    }
    long long call = d->fv_calls - 1; /* this call's index: counted before the fields are read */
    if (d->rules_from_call >= 0 && call < d->rules_from_call) return any;
    if (d->rules_until_call >= 0 && call >= d->rules_until_call) return any;
    for (int k = 0; k < d->n_field_rules; k++) {
        const field_rule_t *rule = &d->field_rules[k];
        if (rule->field_id != id) continue;
        if (rule->scope == scope) return rule->err;
        if (rule->scope == SCOPE_ANY) any = rule->err;
    }
    return any;
}

static void store_value(nvmlFieldValue_t *fv, int vt, unsigned long long v) {
    fv->valueType = vt;
    /* Only the member of the reported type is written, as a C library would. */
    switch (vt) {
        case VT_DOUBLE: fv->value.dVal = (double)v; break;
        case VT_UINT: fv->value.uiVal = (unsigned int)v; break;
        case VT_ULONG: fv->value.ulVal = (unsigned long)v; break;
        case VT_ULL: fv->value.ullVal = v; break;
        case VT_SLL: fv->value.sllVal = (signed long long)v; break;
        case VT_SINT: fv->value.siVal = (signed int)v; break;
        case VT_USHORT: fv->value.usVal = (unsigned short)v; break;
        default: fv->value.ullVal = v; break;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(void *device, int valuesCount, nvmlFieldValue_t *values) {
    count_call(F_nvmlDeviceGetFieldValues);
    if (valuesCount < 0 || (valuesCount > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < valuesCount; i++)
        if (values[i].fieldId < MAX_FIELD_ID) __atomic_add_fetch(&g_field_calls[values[i].fieldId], 1, __ATOMIC_RELAXED);
    fake_device *d = NULL;
    nvmlReturn_t r = enter_device_uncounted(F_nvmlDeviceGetFieldValues, device, &d);
    if (r == NVML_ERROR_GPU_IS_LOST)
        for (int i = 0; i < valuesCount; i++) values[i].nvmlReturn = NVML_ERROR_GPU_IS_LOST;
    if (r) return r;
    d->fv_calls++;
    long long extra = d->field_delay_us * valuesCount;
    if (extra > 0) {
        pthread_mutex_unlock(&g_lock);
        busy_wait_us(extra);
        pthread_mutex_lock(&g_lock);
    }
    long long now = mono_ns();
    long long ts = wall_us();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *fv = &values[i];
        fv->timestamp = is_violation_field(fv->fieldId) && d->q[Q_VIOL_TS] ? (long long)d->q[Q_VIOL_TS] : ts;
        fv->latencyUsec = 0;
        nvmlReturn_t fr = field_rule_error(d, fv->fieldId, fv->scopeId);
        unsigned long long v = 0;
        int vt = VT_UINT;
        if (!fr) fr = field_value(d, fv->fieldId, fv->scopeId, now, &v, &vt);
        fv->nvmlReturn = fr;
        if (fr) continue;
        for (int k = 0; k < d->n_ftype_rules; k++)
            if (d->ftype_rules[k].field_id == fv->fieldId) vt = d->ftype_rules[k].value_type;
        store_value(fv, vt, v);
    }
    return leave(NVML_SUCCESS);
}
