"""Settings, read once and passed down: the engine's (`EngineConfig`, engine.py, from the
environment) and each model's (MODEL.toml, or a preset shipped in presets/: model_settings.py)."""
