"""Byte-identical passthrough, streaming without buffering, header hygiene (real servers)."""

from __future__ import annotations

import gzip
import threading

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from sidecar.sim.servers import serve
from tests.support.runner import run_sidecar

JSON_BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"text":"\xc3\xa9t\xc3\xa9","index":0}]}'
GZIP_BODY = gzip.compress(JSON_BODY)
EVENTS = [f'data: {{"id":"c","choices":[{{"delta":{{"content":"t{i}"}}}}]}}\n\n'.encode() for i in range(5)]


def make_upstream(release_last: threading.Event, seen: list[dict[str, object]]) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.body()
        seen.append({"body": body, "headers": dict(request.headers), "query": request.url.query})
        if b'"stream": true' in body or b'"stream":true' in body:

            async def events():  # type: ignore[no-untyped-def]
                for event in EVENTS[:-1]:
                    yield event
                # The last event waits until the client has seen the first one: no buffering.
                while not release_last.is_set():
                    import asyncio

                    await asyncio.sleep(0.005)
                yield EVENTS[-1]

            return StreamingResponse(events(), media_type="text/event-stream")
        if request.headers.get("accept-encoding") == "gzip":
            return Response(GZIP_BODY, media_type="application/json", headers={"content-encoding": "gzip"})
        return Response(JSON_BODY, media_type="application/json", headers={"x-upstream": "yes"})

    async def anything(request: Request) -> Response:
        body = await request.body()
        seen.append(
            {"body": body, "method": request.method, "path": request.url.path, "query": request.url.query}
        )
        return Response(b"echo:" + body, status_code=207, headers={"x-path": request.url.path})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/{path:path}", anything, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ]
    )


def test_json_and_gzip_are_byte_identical() -> None:
    seen: list[dict[str, object]] = []
    with serve(make_upstream(threading.Event(), seen)) as d, run_sidecar(d.url) as sc:
        body = b'{"model": "m", "prompt": "hi", "kv_transfer_params": null}'
        direct = httpx.post(d.url + "/v1/completions?x=1", content=body)
        proxied = httpx.post(sc.url + "/v1/completions?x=1", content=body)
        assert proxied.content == direct.content == JSON_BODY
        assert proxied.headers["x-upstream"] == "yes"
        proxied_seen = [s for s in seen if s["body"] == body][1]  # D's state probes aside
        assert proxied_seen["query"] == "x=1"  # forwarded untouched
        gz = httpx.post(sc.url + "/v1/completions", content=body, headers={"accept-encoding": "gzip"})
        assert gz.headers["content-encoding"] == "gzip"
        with httpx.stream(
            "POST", sc.url + "/v1/completions", content=body, headers={"accept-encoding": "gzip"}
        ) as raw:
            assert b"".join(raw.iter_raw()) == GZIP_BODY  # not decompressed on the way


def test_sse_first_event_arrives_before_d_sends_the_last() -> None:
    release_last = threading.Event()
    with serve(make_upstream(release_last, [])) as d, run_sidecar(d.url) as sc:
        body = b'{"stream": true, "prompt": "x"}'
        with httpx.stream("POST", sc.url + "/v1/completions", content=body, timeout=10) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            chunks = response.iter_raw()
            first = next(chunks)
            assert first.startswith(EVENTS[0])  # D is still holding back the last event
            release_last.set()
            rest = b"".join(chunks)
        assert first + rest == b"".join(EVENTS)


def test_every_other_method_and_path_passes_through() -> None:
    seen: list[dict[str, object]] = []
    with serve(make_upstream(threading.Event(), seen)) as d, run_sidecar(d.url) as sc:
        for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("PUT", "/x/y"), ("DELETE", "/z")]:
            response = httpx.request(method, sc.url + path + "?q=%20a", content=b"payload")
            assert response.status_code == 207
            assert response.content == b"echo:payload"
            assert response.headers["x-path"] == path
            assert seen[-1]["query"] == "q=%20a"
        # a large streamed upload on a non-inspected route
        big = b"a" * (3 * 1024 * 1024)
        response = httpx.post(sc.url + "/v1/audio/transcriptions", content=iter([big[:1000], big[1000:]]))
        assert response.content == b"echo:" + big


def test_request_id_propagated_or_generated_and_hop_headers_stripped() -> None:
    seen: list[dict[str, object]] = []
    with serve(make_upstream(threading.Event(), seen)) as d, run_sidecar(d.url) as sc:
        response = httpx.post(
            sc.url + "/v1/completions",
            content=b"{}",
            headers={
                "x-request-id": "rid-1",
                "connection": "keep-alive, x-hop",
                "x-hop": "1",
                "authorization": "Bearer k",
            },
        )
        forwarded = seen[-1]["headers"]
        assert isinstance(forwarded, dict)
        assert forwarded["x-request-id"] == "rid-1"
        assert "x-hop" not in forwarded and forwarded["authorization"] == "Bearer k"
        assert response.headers["x-request-id"] == "rid-1"
        generated = httpx.post(sc.url + "/v1/completions", content=b"{}")
        rid = generated.headers["x-request-id"]
        assert len(rid) == 32
        assert seen[-1]["headers"]["x-request-id"] == rid  # type: ignore[index]
        # one Server/Date pair: D's, not a second set from the sidecar
        assert len(generated.headers.get_list("server")) == 1
