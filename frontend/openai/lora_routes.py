"""The LoRA parts of the HTTP API: adapter model cards, and vLLM's runtime endpoints.

```
 GET  /v1/models                  the base model, then each adapter with `parent` (the base) and `root`
 POST /v1/load_lora_adapter       {"lora_name": NAME, "lora_path": FOLDER}   (--allow-runtime-lora-updating)
 POST /v1/unload_lora_adapter     {"lora_name": NAME}                        (--allow-runtime-lora-updating)
```

A load is checked before it is registered (400 with the reason: missing files, shapes that do
not fit the base model, a rank above --max-lora-rank, a name already taken); unloading an
unknown name is 404. Requests already running keep the adapter they started with.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.adapters.peft_folder import AdapterError
from pagedserve.contracts.sampling_params import InvalidParameter
from pagedserve.frontend.lora.registry import AdapterRegistry, UnknownAdapter
from pagedserve.frontend.openai.bodies import model_card
from pagedserve.frontend.openai.errors import HttpError

log = structlog.get_logger()


def adapter_cards(registry: AdapterRegistry | None, created: int, max_model_len: int | None) -> list[dict]:
    cards = []
    for spec in registry.adapters() if registry is not None else []:
        card = model_card(spec.name, created, max_model_len)
        card.update(parent=registry.base_name, root=spec.path)
        cards.append(card)
    return cards


def _name(body, field: str = "lora_name") -> str:
    if not isinstance(body, dict):
        raise InvalidParameter("body", "send a JSON object")
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise InvalidParameter(field, f"{field} must be a non-empty string")
    return value.strip()


def add_runtime_lora_routes(app: FastAPI, registry: AdapterRegistry, read_body: Callable[[Request], Awaitable],
                            guarded: Callable) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        async def answer() -> Response:
            body = await read_body(request)
            name, path = _name(body), _name(body, "lora_path")
            try:
                spec = registry.load(name, path)
            except AdapterError as exc:
                raise HttpError(400, "invalid_request_error", str(exc), param="lora_path",
                                code="invalid_lora_adapter") from None
            log.info("lora_adapter_loaded", lora_name=name, path=spec.path, rank=spec.rank, digest=spec.digest)
            return JSONResponse({"object": "lora_adapter", "lora_name": name, "lora_path": spec.path,
                                 "rank": spec.rank, "digest": spec.digest})
        return await guarded(request, answer)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        async def answer() -> Response:
            name = _name(await read_body(request))
            try:
                registry.unload(name)
            except UnknownAdapter:
                raise HttpError(404, "not_found_error", f"no LoRA adapter named {name!r} is loaded",
                                param="lora_name", code="lora_adapter_not_found") from None
            log.info("lora_adapter_unloaded", lora_name=name)
            return JSONResponse({"object": "lora_adapter", "lora_name": name, "unloaded": True})
        return await guarded(request, answer)
