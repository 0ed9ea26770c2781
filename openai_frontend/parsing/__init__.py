"""Reading a chat output: tool calls (tools/, chat_tools) and reasoning (reasoning,
chat_reasoning), whole or as it streams."""
