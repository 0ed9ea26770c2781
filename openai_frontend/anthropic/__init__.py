"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the chat pipeline."""
