"""pagedserve.frontend.tools: tool calling. Tool definitions and tool_choice from requests, the chat
templates that render tools for model families whose own template has none, the parsers that turn
generated text into tool calls, and the streaming deltas of those calls.

The code map: docs/architecture.md; the topic: docs/tool-calling.md.
"""
