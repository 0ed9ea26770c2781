"""Per-model settings (MODEL.toml, or a preset shipped in presets/)."""
