"""Settings, read once and passed down: the engine's (`EngineConfig`, engine.py, from the
environment), the cache folder (paths.py) and each model's (MODEL.toml, or a preset shipped
in presets/: model_settings.py). Imports only backend.contract."""
