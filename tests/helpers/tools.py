"""A tool the tests call: get_weather(city), as an OpenAI tool and as its function alone."""

WEATHER_FUNCTION = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER = {"type": "function", "function": WEATHER_FUNCTION}
