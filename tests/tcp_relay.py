"""A TCP relay for the object-store tests: ``python tcp_relay.py PORT TARGET [DIE_AFTER]``
forwards 127.0.0.1:PORT to 127.0.0.1:TARGET, both ways; with DIE_AFTER, it SIGKILLs itself
once it has forwarded that many bytes towards TARGET (the store's endpoint dying in the
middle of an upload). Started and killed by ``s3_server.Relay`` only."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

PORT, TARGET = int(sys.argv[1]), int(sys.argv[2])
DIE_AFTER = int(sys.argv[3]) if len(sys.argv) > 3 else None
sent = 0
lock = threading.Lock()


def pipe(src: socket.socket, dst: socket.socket, upstream: bool) -> None:
    global sent
    try:
        while data := src.recv(65536):
            dst.sendall(data)
            if upstream and DIE_AFTER is not None:
                with lock:
                    sent += len(data)
                    if sent >= DIE_AFTER:
                        os.kill(os.getpid(), signal.SIGKILL)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve() -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen(64)
    while True:
        client, _ = listener.accept()
        server = socket.create_connection(("127.0.0.1", TARGET))
        for a, b, up in ((client, server, True), (server, client, False)):
            threading.Thread(target=pipe, args=(a, b, up), daemon=True).start()


if __name__ == "__main__":
    serve()
