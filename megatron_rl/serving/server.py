"""The OpenAI-compatible HTTP endpoint: aiohttp on an event loop of its own thread, in the process that owns the
generator (a training job's generator replica leader, or `megatron-rl serve`).

    GET  /v1/models                          the model served
    POST /v1/chat/completions                a chat completion (`serve`'s requests)
    POST /v1/completions                     a text completion, the prompt as text or token ids
    POST /s/<session>/v1/chat/completions    a request of one agent episode (`agents/`), its conversation kept
    GET  /s/<session>/v1/models

Every request must carry the run's key (`Authorization: Bearer <key>`, what an OpenAI client's `api_key` sends); the
endpoint listens on 127.0.0.1 unless told otherwise. The loop thread only parses, checks and answers: each request
is handed to a handler (`handle(kind, body)`, kind "chat" or "completion") that returns a `concurrent.futures.Future`
of the response body, resolved from the generator's thread; a `ProtocolError` (raised, or set on the future) is an
error body with its status.

Why aiohttp (docs/dependencies.md): one well-kept package that is both the server and its own event loop, started and
stopped from any thread without taking over the process's signal handlers, which the job's launcher owns.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
from concurrent.futures import Future
from typing import Callable, Optional

from megatron_rl.serving.protocol import ProtocolError, error_body, models_body

Handler = Callable[[str, dict], Future]


class Endpoint:
    """The HTTP endpoint (module docstring). `handler`: for `/v1/...` requests (None: refused, 404); sessions are
    opened and closed by their owner (`open_session`)."""

    def __init__(self, model: str, key: str, handler: Optional[Handler] = None, host: str = "127.0.0.1",
                 port: int = 0):
        self.model, self.key, self.handler, self.host, self.port = model, key, handler, host, port
        self.sessions: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stop: Optional[asyncio.Event] = None

    # ---- addresses ---------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def session_url(self, session: str) -> str:
        return f"http://{self.host}:{self.port}/s/{session}/v1"

    def open_session(self, session: str, handler: Handler) -> None:
        with self._lock:
            self.sessions[session] = handler

    def close_session(self, session: str) -> None:
        with self._lock:
            self.sessions.pop(session, None)

    # ---- the loop's thread -------------------------------------------------------------------------------------
    def start(self) -> "Endpoint":
        """Listen (returns once the port is bound; `port` 0 takes a free one)."""
        ready: Future = Future()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="megatron-rl-endpoint", daemon=True)
        self._thread.start()
        ready.result(timeout=60)
        return self

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=30)
            self._loop = None

    def _serve(self, ready: Future) -> None:
        from aiohttp import web

        async def main():
            app = web.Application(client_max_size=64 * 2**20)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", lambda r: self._complete(r, "chat", None))
            app.router.add_post("/v1/completions", lambda r: self._complete(r, "completion", None))
            app.router.add_get("/s/{session}/v1/models", self._models)
            app.router.add_post("/s/{session}/v1/chat/completions",
                                lambda r: self._complete(r, "chat", r.match_info["session"]))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            try:
                await site.start()
            except OSError as e:
                ready.set_exception(OSError(f"cannot listen on {self.host}:{self.port}: {e.strerror or e}"))
                await runner.cleanup()
                return
            self.port = site._server.sockets[0].getsockname()[1]
            self._stop = asyncio.Event()
            ready.set_result(None)
            await self._stop.wait()
            await runner.cleanup()

        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(main())
        except BaseException as e:  # noqa: BLE001 - reported to `start`
            if not ready.done():
                ready.set_exception(e)
        finally:
            self._loop.close()

    # ---- requests ----------------------------------------------------------------------------------------------
    def _authorized(self, request) -> bool:
        given = request.headers.get("Authorization", "")
        return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), self.key.encode())

    @staticmethod
    def _json(status: int, body: dict):
        from aiohttp import web

        return web.json_response(body, status=status)

    async def _models(self, request):
        if not self._authorized(request):
            return self._json(401, error_body("a missing or wrong API key: pass the run's key", "invalid_api_key"))
        return self._json(200, models_body(self.model))

    async def _complete(self, request, kind: str, session: Optional[str]):
        if not self._authorized(request):
            return self._json(401, error_body("a missing or wrong API key: pass the run's key", "invalid_api_key"))
        with self._lock:
            handler = self.handler if session is None else self.sessions.get(session)
        if handler is None:
            what = f"no episode {session!r} is running" if session is not None else \
                "this endpoint serves agent episodes only: use the base URL the job gave the agent"
            return self._json(404, error_body(what, "not_found"))
        try:
            body = await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError):
            return self._json(400, error_body("the body is not JSON"))
        try:
            result = await asyncio.wrap_future(handler(kind, body))
        except ProtocolError as e:
            return self._json(e.status, error_body(str(e), e.code))
        return self._json(200, result)
