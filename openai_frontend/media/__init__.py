"""Media in chat messages (images, videos), made ready for the vision encoder: images.py
(decoding, Qwen2-VL's preprocessing), video.py (PyAV), sources.py (the URL policy),
settings.py (the limits, as the frontend's Settings passes them), parts.py (the chat path:
parts -> VisionItems and the prompt's placeholders)."""

from openai_frontend.media.images import MediaError, PreparedImage, Qwen2VLImages, decode_image

__all__ = ["MediaError", "PreparedImage", "Qwen2VLImages", "decode_image"]
