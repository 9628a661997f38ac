"""One idle client of the Python binding, for bench/src/bin/idle_client.rs.

python3 idle_client.py BINDINGS SERVER CA_PEM TOKEN foreground|background

BINDINGS is the directory with the generated greendot_ffi.py and
libgreendot_ffi.so (clients/python/README.md, "Install"). Connects, registers
a listener, goes to the background if asked, prints `ready`, then stays idle
in an asyncio loop (as an app's would be) until stdin closes; then prints
`done disconnects=N` and closes without logging out.
"""

import asyncio
import sys

BINDINGS, SERVER, CA, TOKEN, STATE = sys.argv[1:6]
sys.path.insert(0, BINDINGS)
import greendot_ffi as gd  # noqa: E402


class Counter(gd.PresenceListener):
    """Counts lost connections (called on the library's listener thread)."""

    def __init__(self):
        self.disconnects = 0

    def on_event(self, event):
        if event.is_disconnected():
            self.disconnects += 1


async def main():
    with open(CA) as f:
        pem = f.read()
    client = await gd.connect(gd.ConnectConfig(addresses=[SERVER], token=TOKEN, ca_certificates_pem=pem))
    counter = Counter()
    handle = client.listen(counter)
    if STATE == "background":
        client.app_backgrounded()
    print("ready", flush=True)
    # The loop waits on stdin in epoll: no thread and no timer of its own.
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()
    print(f"done disconnects={counter.disconnects}", flush=True)
    handle.cancel()
    await client.close()


asyncio.run(main())
