"""Tool calling: tool definitions and tool_choice from requests (tool_request.py), the chat
templates that render tools for model families whose own template has none (tool_templates.py),
the parsers that turn generated text into tool calls (tool_parsers.py) and the streaming deltas
of those calls (tool_stream.py)."""
