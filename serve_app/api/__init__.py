"""Wire formats and HTTP: the OpenAI, Anthropic and Responses APIs, routes, keys."""
