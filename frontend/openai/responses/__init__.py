"""POST /v1/responses (stateless): protocol (parsing), objects, streaming (events), serving."""
