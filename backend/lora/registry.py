"""The adapters the server knows: names, slots, versions, and their weights in host memory.

Thread-safe: commands come on their own threads, requests resolve their slot on
Triton's, and the engine thread reads weights. A name gets a slot the first time it
is loaded and keeps it; every load makes a new `AdapterVersion` (numbers never
reused), and the one it replaces is retired: the requests pinned to it finish on it,
new ones get the new one. Weights of at most MAX_CPU_LORAS versions stay in host
memory (least recently used beyond); an evicted version is read from its folder again
when needed, and refused if the folder changed since it was loaded.
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass

from backend.contract import (
    BASE_SLOT,
    FOLLOW_ACTIVE,
    AdapterCommand,
    AdapterInfo,
    AdapterNotFound,
    AdapterTable,
    ContractError,
)
from backend.lora.peft_format import LoraWeights, folder_digest, largest_adapter_bytes, read_adapter
from backend.types.model_config import ModelConfig


@dataclass(eq=False, slots=True)
class AdapterVersion:
    """One load of an adapter: what a request pins for its life."""

    name: str
    slot: int
    version: int
    path: str
    rank: int
    digest: str

    def info(self) -> AdapterInfo:
        return AdapterInfo(self.name, self.slot, self.version, self.path, self.rank)


@dataclass(slots=True)
class LoraConfig:
    max_loras: int = 4  # adapters resident for the forward at once (MAX_LORAS)
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # versions' weights kept in host memory; None: max_loras
    max_file_bytes: int | None = None  # an adapter's weights file (MAX_LORA_FILE_BYTES); None: largest_adapter_bytes


class AdapterRegistry:
    @classmethod
    def for_engine(cls, config, model: ModelConfig) -> AdapterRegistry | None:
        """The engine's registry from its EngineConfig, LORA_MODULES loaded and ACTIVE_LORA
        made active (ValueError naming the variable otherwise); None when MAX_LORAS is 0."""
        if config.max_loras <= 0:
            if config.lora_modules or config.active_lora:
                raise ValueError("LORA_MODULES / ACTIVE_LORA are set, but MAX_LORAS=0 serves no adapters")
            return None
        lora = LoraConfig(config.max_loras, config.max_lora_rank, config.max_cpu_loras, config.max_lora_file_bytes)
        if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
            raise ValueError(f"MAX_CPU_LORAS={lora.max_cpu_loras} must be at least MAX_LORAS={lora.max_loras}")
        if lora.max_file_bytes is not None and lora.max_file_bytes < 1:
            raise ValueError(f"MAX_LORA_FILE_BYTES={lora.max_file_bytes} must be positive")
        registry = cls(model, lora)
        for name, path in parse_modules(config.lora_modules):
            try:
                registry.load(name, path)
            except ContractError as exc:
                raise ValueError(f"LORA_MODULES: adapter {name!r}: {exc.message}") from None
        try:
            registry.activate(config.active_lora)
        except ContractError:
            raise ValueError(f"ACTIVE_LORA={config.active_lora!r} names no adapter of LORA_MODULES") from None
        return registry

    def __init__(self, model: ModelConfig, config: LoraConfig):
        self.model, self.config = model, config
        self.capacity = max(config.max_cpu_loras or config.max_loras, config.max_loras)
        self.max_file_bytes = config.max_file_bytes or largest_adapter_bytes(model, config.max_lora_rank)
        self._lock = threading.Lock()
        self._current: dict[str, AdapterVersion] = {}  # by name
        self._slots: dict[str, int] = {}  # every name ever loaded -> its slot
        self._active = ""
        self._host: collections.OrderedDict[AdapterVersion, LoraWeights] = collections.OrderedDict()
        self._versions = itertools.count(1)

    # -- commands (any thread) ------------------------------------------------

    def command(self, command: AdapterCommand) -> AdapterTable:
        """Run an adapter command; the table after it. ContractError naming the field."""
        if command.op == "load":
            self.load(command.lora_name, command.lora_path)
        elif command.op == "unload":
            self.unload(command.lora_name)
        elif command.op == "activate":
            self.activate(command.lora_name)
        return self.table()

    def load(self, name: str, path: str) -> AdapterVersion:
        """Register (or replace) `name` from the PEFT folder `path`."""
        if not name or "," in name or name.strip() != name:
            raise ContractError("lora_name", f"{name!r} is not a usable adapter name (no commas, no outer spaces)")
        weights = self._read(path)  # the slow part, unlocked
        with self._lock:
            slot = self._slots.setdefault(name, len(self._slots) + 1)
            version = AdapterVersion(name, slot, next(self._versions), str(path), weights.rank, weights.digest)
            self._current[name] = version
            self._keep(version, weights)
        return version

    def unload(self, name: str) -> None:
        """Forget `name`: new requests for it are refused; pinned ones finish on their version."""
        with self._lock:
            if self._current.pop(name, None) is None:
                raise AdapterNotFound("lora_name", f"no adapter named {name!r} is loaded")
            if self._active == name:
                self._active = ""

    def activate(self, name: str) -> None:
        """Make `name` the adapter adapter_slot -1 follows ("": the base model)."""
        with self._lock:
            if name and name not in self._current:
                raise AdapterNotFound("lora_name", f"no adapter named {name!r} is loaded")
            self._active = name

    def table(self) -> AdapterTable:
        with self._lock:
            adapters = [v.info() for v in sorted(self._current.values(), key=lambda v: v.slot)]
            return AdapterTable(adapters, self._active, self.config.max_loras, self.config.max_lora_rank)

    # -- requests --------------------------------------------------------------

    def resolve(self, slot: int) -> AdapterVersion | None:
        """The version a request with `adapter_slot` gets (None: the base model)."""
        with self._lock:
            if slot == BASE_SLOT or (slot == FOLLOW_ACTIVE and not self._active):
                return None
            if slot == FOLLOW_ACTIVE:
                return self._current[self._active]
            version = next((v for v in self._current.values() if v.slot == slot), None)
        if version is None:
            raise AdapterNotFound("adapter_slot", f"no adapter is loaded in slot {slot}")
        return version

    def weights(self, version: AdapterVersion) -> LoraWeights:
        """The version's weights, from host memory or read again from its folder."""
        with self._lock:
            weights = self._host.get(version)
            if weights is not None:
                self._host.move_to_end(version)
                return weights
        if folder_digest(version.path, self.max_file_bytes) != version.digest:
            raise ContractError(
                "adapter_slot",
                f"adapter {version.name!r}'s folder {version.path} changed since it was loaded; load it again",
            )
        weights = self._read(version.path)
        with self._lock:
            self._keep(version, weights)
        return weights

    def _read(self, path: str) -> LoraWeights:
        return read_adapter(path, self.model, self.config.max_lora_rank, self.max_file_bytes)

    def _keep(self, version: AdapterVersion, weights: LoraWeights) -> None:
        self._host[version] = weights
        self._host.move_to_end(version)
        while len(self._host) > self.capacity:
            self._host.popitem(last=False)


def parse_modules(text: str) -> list[tuple[str, str]]:
    """LORA_MODULES: `name=path` pairs separated by commas (vLLM's --lora-modules form)."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"LORA_MODULES: expected name=path pairs separated by commas, got {item!r}")
        pairs.append((name.strip(), path.strip()))
    return pairs
