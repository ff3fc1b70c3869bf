"""A reverse proxy that serves an app under a path prefix and strips it, as nginx's
`location /school/ { proxy_pass http://127.0.0.1:8501/; }` does.

    python3 tests/proxy.py LISTEN_PORT UPSTREAM_PORT PREFIX

HTTP requests and WebSockets under `/PREFIX/` go to `127.0.0.1:UPSTREAM_PORT`
without the prefix; anything else is answered 404, so a page that asks for
a file outside the prefix (an address built from the server's view of its
root) fails as it would behind the real proxy. Only for tests: uvicorn and
websockets come with Streamlit.
"""

import asyncio
import http.client
import sys

import anyio
import uvicorn
import websockets

# Hop-by-hop headers a proxy does not pass on (and the length it sets itself).
_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "upgrade",
    "proxy-connection",
    "te",
    "trailer",
    "content-length",
    "host",
}


def make_app(upstream_port, prefix):
    prefix = "/" + prefix.strip("/")

    def upstream_path(path):
        if path != prefix and not path.startswith(prefix + "/"):
            return None
        return path[len(prefix) :] or "/"

    def fetch(method, target, headers, body):
        conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=120)
        try:
            conn.request(method, target, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()

    async def respond(send, status, headers, body):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = upstream_path(scope["path"])
        if path is None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await respond(send, 404, [(b"content-type", b"text/plain")], b"outside the prefix")
            return
        query = scope["query_string"].decode()
        target = path + (f"?{query}" if query else "")
        headers = {
            k.decode(): v.decode() for k, v in scope["headers"] if k.decode().lower() not in _HOP
        }
        if scope["type"] == "http":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            status, got, data = await anyio.to_thread.run_sync(
                fetch, scope["method"], target, headers, body
            )
            kept = [(k.lower().encode(), v.encode()) for k, v in got if k.lower() not in _HOP]
            await respond(send, status, kept + [(b"content-length", str(len(data)).encode())], data)
            return
        protocols = [
            p.strip()
            for k, v in scope["headers"]
            if k == b"sec-websocket-protocol"
            for p in v.decode().split(",")
        ]
        passed = {k: v for k, v in headers.items() if k.lower() in ("cookie", "origin")}
        upstream = await websockets.connect(
            f"ws://127.0.0.1:{upstream_port}{target}",
            subprotocols=protocols or None,
            additional_headers=passed,
            max_size=None,
        )
        await receive()  # websocket.connect
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

        async def down():
            async for message in upstream:
                key = "bytes" if isinstance(message, bytes) else "text"
                await send({"type": "websocket.send", key: message})

        async def up():
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                await upstream.send(
                    message["bytes"] if message.get("bytes") is not None else message["text"]
                )

        tasks = [asyncio.create_task(down()), asyncio.create_task(up())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        await upstream.close()

    return app


if __name__ == "__main__":
    listen, upstream, prefix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    uvicorn.run(make_app(upstream, prefix), host="127.0.0.1", port=listen, log_level="warning")
