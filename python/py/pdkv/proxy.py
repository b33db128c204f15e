"""A small P/D router for engines running pdkv's connector (or vLLM's MoRIIO).

Each completion goes to a prefill server first, with ``max_tokens`` 1 and
``kv_transfer_params = {"do_remote_decode": true, "transfer_id": "tx-<uuid4 hex>"}``; the
``kv_transfer_params`` prefill answers with (where its KV is: engine, host, ports, blocks) go
unchanged to a decode server with the original request, whose answer is the client's. Prefill
and decode servers are taken in turn. It speaks ``/v1/completions`` and ``/v1/chat/completions``,
streaming or not, and answers ``/health``.

    python -m pdkv.proxy --prefill http://10.0.0.5:8100 --decode http://10.0.0.6:8200 --port 8000

It uses aiohttp, which vLLM installs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import uuid
from typing import Any

logger = logging.getLogger("pdkv.proxy")


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The request prefill gets: one token, no streaming, and the ask to keep the KV."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("min_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The request decode gets: the client's, with prefill's answer."""
    out = dict(body)
    out["kv_transfer_params"] = params
    return out


def make_app(prefill: list[str], decode: list[str], timeout_s: float):
    from aiohttp import ClientSession, ClientTimeout, web

    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)

    async def start(app: web.Application) -> None:
        from aiohttp import TCPConnector

        # A connection per request, never a pooled one: a server may close an idle keep-alive
        # connection (uvicorn does after 5 s) just as a request is written to it, and then
        # whether the server saw the request cannot be known, so it cannot safely be sent
        # again. Under load on a small host this lost one request in a few hundred; a new
        # loopback or LAN connection costs far less than the request it carries.
        connector = TCPConnector(force_close=True)
        app["session"] = ClientSession(timeout=ClientTimeout(total=timeout_s), connector=connector)

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    def error(status: int, message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "pdkv_proxy"}}, status=status)

    async def forward(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as e:
            return error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the body is not a JSON object")
        session = request.app["session"]
        transfer_id = f"tx-{uuid.uuid4().hex}"
        p_url, d_url = next(prefills), next(decodes)
        async with session.post(p_url + request.path, json=prefill_body(body, transfer_id)) as r:
            text = await r.text()
            if r.status != 200:
                return error(502, f"prefill {p_url} answered {r.status}: {text[:2000]}")
        try:
            params = json.loads(text).get("kv_transfer_params")
        except ValueError:
            return error(502, f"prefill {p_url} answered no JSON")
        if not params:
            return error(
                502,
                f"prefill {p_url} answered without kv_transfer_params: is its connector configured "
                "with kv_role kv_producer?",
            )
        logger.debug("%s: prefill %s answered %s", transfer_id, p_url, params)
        async with session.post(d_url + request.path, json=decode_body(body, params)) as r:
            logger.debug("%s: decode %s answered %d", transfer_id, d_url, r.status)
            if not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"prefill": prefill, "decode": decode})

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", forward)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdkv.proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, metavar="URL", help="a prefill server (repeat for more)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode server (repeat for more)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one leg may take")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            parser.error(f"{url!r} is not an http:// or https:// URL")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from aiohttp import web

    app = make_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], args.timeout)
    web.run_app(app, host=args.host, port=args.port, print=lambda *_: None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
