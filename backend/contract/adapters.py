"""LoRA adapters on the wire: the commands that manage them and the table the model answers with.

The engine owns the adapters (backend.lora): LORA_MODULES registers some at start, and
an `AdapterCommand` sent to model `llm` (the `adapter_command` input, alone) lists,
loads, unloads or activates one; every command is answered with the `AdapterTable`
as it stands after it. A request picks an adapter by `GenerationRequest.adapter_slot`:

- 0: the base model, no adapter;
- N > 0: the adapter registered in slot N (the table's `slot`); a name keeps its slot
  when it is loaded again (a new version), and a slot is never given to another name;
- -1 (FOLLOW_ACTIVE): the adapter the server made active (ACTIVE_LORA, or the
  `activate` command), or the base model when none is.

The engine resolves the slot when it admits a request and pins that adapter version
for the request's life. A failed command is a ContractError naming `lora_name` or
`lora_path` (`AdapterNotFound` when the name is not registered).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from backend.contract.errors import ContractError

BASE_SLOT = 0
FOLLOW_ACTIVE = -1
COMMANDS = ("list", "load", "unload", "activate")
MAX_PATH_CHARS = 4096  # Linux PATH_MAX: a longer lora_path names no folder


class AdapterNotFound(ContractError):
    """The command or request names an adapter (or slot) that is not registered."""

    not_found = True  # ErrorReport's kind: NOT_FOUND


@dataclass(frozen=True, slots=True)
class AdapterCommand:
    """list | load (name, path: a PEFT folder; an existing name is replaced by a new
    version) | unload (name) | activate (name; "" makes the base model active)."""

    op: str
    lora_name: str = ""
    lora_path: str = ""

    def check(self) -> None:
        if self.op not in COMMANDS:
            raise ContractError("adapter_command", f"op must be one of {list(COMMANDS)}, got {self.op!r}")
        if self.op in ("load", "unload") and not self.lora_name:
            raise ContractError("lora_name", f"is required to {self.op} an adapter")
        if self.op == "load" and not self.lora_path:
            raise ContractError("lora_path", "is required to load an adapter")
        if len(self.lora_path) > MAX_PATH_CHARS or "\0" in self.lora_path:
            raise ContractError("lora_path", f"must be a folder's path: at most {MAX_PATH_CHARS} characters, no NUL")

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> AdapterCommand:
        try:
            data = json.loads(text)
            command = cls(str(data["op"]), str(data.get("lora_name") or ""), str(data.get("lora_path") or ""))
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ContractError("adapter_command", 'must be a JSON object {"op", "lora_name", "lora_path"}') from None
        command.check()
        return command


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    slot: int  # what a request's adapter_slot names it by
    version: int  # new at every load, never reused: what the prefix cache is keyed by
    path: str
    rank: int  # its largest rank over the modules it adapts


@dataclass(frozen=True, slots=True)
class AdapterTable:
    adapters: list[AdapterInfo] = field(default_factory=list)
    active: str = ""  # the adapter adapter_slot -1 follows; "": the base model
    max_loras: int = 0  # adapters in one step at most (MAX_LORAS); 0: the server serves none
    max_lora_rank: int = 0

    def by_name(self, name: str) -> AdapterInfo | None:
        return next((a for a in self.adapters if a.name == name), None)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> AdapterTable:
        data = json.loads(text)
        adapters = [AdapterInfo(**a) for a in data.pop("adapters")]
        return cls(adapters, **data)
