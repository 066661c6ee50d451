"""GPU and host telemetry, with no UI code (the panel renders what this returns).

`NvmlSource` reads nvidia-ml-py. Every call tolerates NotSupported and a lost
GPU (the field becomes None), and slow fields are cached: PCIe throughput
blocks ~20 ms per counter (docs/FACTS.md), so it is read every `slow_interval`
seconds, not every sample. `SimulatedSource` produces plausible numbers for
demos and tests on machines without GPUs; everything it returns is marked
simulated, and the panel says so wherever it shows them.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from dataclasses import dataclass, field


@dataclass
class GpuSample:
    index: int
    name: str
    mem_used: int | None = None      # bytes
    mem_total: int | None = None
    util: float | None = None        # percent
    temp: float | None = None        # Celsius
    power: float | None = None       # watts
    power_limit: float | None = None
    pcie_rx: float | None = None     # bytes/s
    pcie_tx: float | None = None
    error: str | None = None         # e.g. "GPU is lost"
    simulated: bool = False


@dataclass
class HostSample:
    cpu_percent: float
    mem_used: int
    mem_total: int
    disk_free: int | None
    disk_total: int | None


@dataclass
class Snapshot:
    t: float
    gpus: list[GpuSample]
    host: HostSample | None
    source: str                       # "nvml" | "simulated" | "none"
    banner: str | None = None         # why there are no GPU numbers
    nodes: list = field(default_factory=list)   # cluster nodes (pipeline.cluster.node_telemetry)


class NvmlSource:
    kind = "nvml"

    def __init__(self, slow_interval: float = 5.0):
        import pynvml
        self.nv = pynvml
        pynvml.nvmlInit()  # raises NVMLError_LibraryNotFound without a driver
        self.count = pynvml.nvmlDeviceGetCount()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]
        self.names = [self._call(lambda h=h: pynvml.nvmlDeviceGetName(h)) or "GPU"
                      for h in self.handles]
        self.names = [n.decode() if isinstance(n, bytes) else n for n in self.names]
        self.slow_interval = slow_interval
        self._slow: dict[int, tuple[float, float | None, float | None]] = {}
        self._limits: dict[int, float | None] = {}
        self._mem_v2 = hasattr(pynvml, "nvmlMemory_v2")

    def _call(self, fn):
        try:
            return fn()
        except self.nv.NVMLError:
            return None

    def sample(self) -> list[GpuSample]:
        nv, now, out = self.nv, time.monotonic(), []
        for i, h in enumerate(self.handles):
            s = GpuSample(i, self.names[i])
            try:
                mem = self._memory(h)
                s.mem_used, s.mem_total = mem.used, mem.total
            except nv.NVMLError as e:
                if isinstance(e, getattr(nv, "NVMLError_GpuIsLost", ())):
                    s.error = "GPU is lost"
                    out.append(s)
                    continue
            util = self._call(lambda h=h: nv.nvmlDeviceGetUtilizationRates(h))
            s.util = float(util.gpu) if util is not None else None
            s.temp = self._call(
                lambda h=h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
            mw = self._call(lambda h=h: nv.nvmlDeviceGetPowerUsage(h))
            s.power = mw / 1000 if mw is not None else None
            if i not in self._limits:  # constant: read once
                lim = self._call(lambda h=h: nv.nvmlDeviceGetEnforcedPowerLimit(h))
                self._limits[i] = lim / 1000 if lim is not None else None
            s.power_limit = self._limits[i]
            t, rx, tx = self._slow.get(i, (-math.inf, None, None))
            if now - t >= self.slow_interval:
                rx = self._call(
                    lambda h=h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES))
                tx = self._call(
                    lambda h=h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES))
                rx, tx = (rx * 1024 if rx is not None else None), (tx * 1024 if tx is not None else None)
                self._slow[i] = (now, rx, tx)
            s.pcie_rx, s.pcie_tx = rx, tx
            out.append(s)
        return out

    def inventory(self) -> list[dict]:
        """Index, name and memory total of each GPU (what doctor plans with)."""
        return [{"index": i, "name": self.names[i], "memory_total": int(self._memory(h).total)}
                for i, h in enumerate(self.handles)]

    def _memory(self, h):
        """Memory info as nvidia-smi reports it. The v1 call counts the
        driver's reserved memory as used (measured on an H200: 618 MiB used
        on an idle GPU where nvidia-smi says 4); v2 reports it apart."""
        nv = self.nv
        if self._mem_v2:
            try:
                return nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
            except (nv.NVMLError_FunctionNotFound, nv.NVMLError_NotSupported, TypeError):
                self._mem_v2 = False  # an older driver or binding: v1 from now on
        return nv.nvmlDeviceGetMemoryInfo(h)

    def close(self) -> None:
        self._call(self.nv.nvmlShutdown)


class SimulatedSource:
    """SIMULATED GPUs: a deterministic random walk, labelled as such."""

    kind = "simulated"

    def __init__(self, n: int, seed: int = 0, name: str = "Simulated H200"):
        self.rng = random.Random(seed)
        self.n = n
        self.name = name
        self.total = 143_771_000_000
        self.state = [[0.3 + 0.05 * i, 40.0] for i in range(n)]

    def sample(self) -> list[GpuSample]:
        out = []
        for i in range(self.n):
            mem, util = self.state[i]
            mem = min(0.97, max(0.02, mem + self.rng.uniform(-0.02, 0.02)))
            util = min(100.0, max(0.0, util + self.rng.uniform(-12, 12)))
            self.state[i] = [mem, util]
            out.append(GpuSample(
                i, self.name, mem_used=int(mem * self.total), mem_total=self.total, util=util,
                temp=35 + util * 0.4, power=90 + util * 5.5, power_limit=700.0,
                pcie_rx=util * 2.5e8, pcie_tx=util * 1.0e8, simulated=True))
        return out

    def close(self) -> None:
        return None


def host_sample(disk_path=None) -> HostSample:
    import psutil
    vm = psutil.virtual_memory()
    free = total = None
    if disk_path is not None:
        try:
            du = shutil.disk_usage(disk_path)
            free, total = du.free, du.total
        except OSError:
            pass
    return HostSample(psutil.cpu_percent(interval=None), vm.total - vm.available, vm.total,
                      free, total)


class Telemetry:
    """One sampler for the panel: GPUs (NVML, simulated or none) plus host."""

    MIN_INTERVAL = 0.5

    def __init__(self, simulate: int = 0, disk_path=None, host: bool = True):
        self.disk_path = disk_path
        self.host = host
        self.banner = None
        self.source = None
        if simulate:
            self.source = SimulatedSource(simulate)
        else:
            try:
                self.source = NvmlSource()
            except Exception as e:  # noqa: BLE001 - no driver, no library, no GPU
                self.banner = (f"no NVIDIA GPU telemetry ({type(e).__name__}); host stats only. "
                               "`eagle-panel ui --simulate-gpus 8` shows simulated GPUs")

    @property
    def kind(self) -> str:
        return self.source.kind if self.source else "none"

    def sample(self) -> Snapshot:
        gpus: list[GpuSample] = []
        if self.source is not None:
            try:
                gpus = self.source.sample()
            except Exception as e:  # noqa: BLE001 - the driver went away mid-run
                self.banner = f"GPU telemetry stopped: {e}"
                self.source = None
        host = host_sample(self.disk_path) if self.host else None
        return Snapshot(time.time(), gpus, host, self.kind, self.banner)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
