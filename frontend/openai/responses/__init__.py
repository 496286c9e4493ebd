"""pagedserve.frontend.openai.responses: POST /v1/responses (stateless), parsed apart from served
apart from streamed.

The code map: docs/architecture.md; the topic: docs/responses-api.md.
"""
