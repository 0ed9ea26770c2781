"""The OpenAI API surface: request and response shapes, the routes and their handlers
(chat, completions), the request builder (body -> the contract's request), SSE, errors."""
