"""Media in chat messages (images, video frames), made ready for the vision encoder."""

from openai_frontend.media.images import MediaError, PreparedImage, Qwen2VLImages, decode_data_url

__all__ = ["MediaError", "PreparedImage", "Qwen2VLImages", "decode_data_url"]
