"""Every error the server answers with, in OpenAI's shape so existing clients show the message:
{"error": {"message", "type", "param", "code"}}. Validation errors name the field and the element
(`keys[3][1]: Input should be a finite number`) and never echo the request body back."""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from pagevis.kvcache import ConfigError
from pagevis.model.chat_template import ChatTemplateError
from pagevis.settings import by_path

log = logging.getLogger("pagevis.serve")

MAX_LISTED_ERRORS = 10
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error",
               413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}


class ApiError(Exception):
    """An answer with a status and a message the client can act on."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, **extra) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.extra = status, message, param, code, extra
        self.headers = headers


class FieldError(HTTPException):
    """A 4xx found while the body is read, before the route runs (FastAPI re-raises HTTPExceptions there)."""

    def __init__(self, status: int, message: str, param: str) -> None:
        super().__init__(status, message)
        self.param = param


def server_fault(request: Request, error: BaseException) -> ApiError:
    """A bug or a fault of the server's own: logged with its traceback under a request id the answer names."""
    ident = secrets.token_hex(6)
    log.error("request %s: %s %s failed", ident, request.method, request.url.path, exc_info=error)
    return ApiError(500, f"internal error (request id {ident}): {type(error).__name__}: {error}",
                    code="internal_error", request_id=ident)


def lone_surrogate(value) -> tuple[str, int, str] | None:
    """The first string in a parsed JSON value holding a lone surrogate: (its path, the index, the character)."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                return path or "body", error.start, item[error.start]
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                stack.append((f"{path}.{key}" if path else str(key), inner))
                stack.append((path or "body", key))  # a key is checked as text where its object is
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", inner) for i, inner in reversed(list(enumerate(item))))
    return None


class CheckedRequest(Request):
    """A request whose JSON body is refused (422 naming the field) if any string in it is not valid Unicode:
    JSON may spell a lone surrogate ("\\ud800"), which no tokenizer and no UTF-8 answer can hold."""

    async def json(self):
        if not hasattr(self, "_json"):
            value = await super().json()
            found = lone_surrogate(value)
            if found is not None:
                path, index, char = found
                raise FieldError(422, f"{path}: a lone surrogate (U+{ord(char):04X}) at character {index}; text "
                                      "must be valid Unicode", param=path.split("[")[0].split(".")[0])
        return self._json


class CheckedRoute(APIRoute):
    """Every route reads its body through CheckedRequest."""

    def get_route_handler(self):
        handle = super().get_route_handler()

        async def checked(request: Request):
            return await handle(CheckedRequest(request.scope, request.receive))
        return checked


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, **extra) -> dict:
    error = {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}
    error.update(extra)
    return {"error": error}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, **extra) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, **extra), status_code=status, headers=headers)


def request_field(config_field: str) -> str:
    """The request field a ConfigError's field is set by, from the settings table (`sampling.temperature`
    -> `temperature`, `max_new_tokens` -> `max_tokens`), policy parameters under `policy_params`."""
    setting = by_path(config_field)
    if setting is not None:
        return setting.dest
    if "." in config_field:
        return "policy_params." + config_field.split(".", 1)[1]
    return config_field


def config_error(error: ConfigError) -> ApiError:
    field = request_field(error.field)
    return ApiError(422, f"{field} = {error.value!r} is not allowed: {error.allowed}", param=field,
                    code="invalid_value", allowed=error.allowed)


def element_path(loc) -> str:
    """('body', 'keys', 'list[list[float]]', 3, 1) -> 'keys[3][1]' (union member tags dropped)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" not in str(part) and "-" not in str(part):
            path += f".{part}" if path else str(part)
    return path or "body"


def most_specific(errors: list[dict]) -> dict:
    """Of a union's alternatives, the error that got furthest into the value (the one the client meant)."""
    return max(errors, key=lambda e: (len(e["loc"]), e["type"] not in ("list_type", "float_type", "model_type")))


def _union_branch(loc) -> str | None:
    return next((part for part in loc if isinstance(part, str) and "[" in part), None)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError):
        return error_response(error.status, error.message, error.param, error.code, error.headers, **error.extra)

    @app.exception_handler(ConfigError)
    async def _config_error(_request: Request, error: ConfigError):
        api = config_error(error)
        return error_response(api.status, api.message, api.param, api.code, **api.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, error: RequestValidationError):
        errors = list(error.errors())
        first = most_specific(errors)
        path = element_path(first["loc"])
        branch = _union_branch(first["loc"])  # list the alternative the client meant, not every union member
        details = [{"loc": element_path(e["loc"]), "msg": e["msg"], "type": e["type"]}
                   for e in errors if _union_branch(e["loc"]) in (branch, None)][:MAX_LISTED_ERRORS]
        return error_response(422, f"{path}: {first['msg']}", param=path.split("[")[0].split(".")[0],
                              code=first["type"], details=details)

    @app.exception_handler(ChatTemplateError)
    async def _template_error(_request: Request, error: ChatTemplateError):  # the request's text, rendered
        message = str(error) if str(error).startswith("messages") else f"messages: {error}"
        return error_response(422, message, param="messages", code="chat_template")

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception):  # a bug: still JSON, with what went wrong
        api = server_fault(request, error)
        return error_response(api.status, api.message, api.param, api.code, **api.extra)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, error: HTTPException):
        message = error.detail if isinstance(error.detail, str) else str(error.detail)
        return JSONResponse(error_body(error.status_code, message, getattr(error, "param", None)),
                            status_code=error.status_code, headers=getattr(error, "headers", None))
