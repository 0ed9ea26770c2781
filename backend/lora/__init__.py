"""LoRA adapters: PEFT folders read and checked, the registry of names, slots and versions,
the lanes that hold versions for the forward, and the batched low-rank update in it."""
