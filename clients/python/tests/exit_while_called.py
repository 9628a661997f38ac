"""The interpreter exits while a thread of the library's is in Python.

Run by tests/tests/python_client.rs with the environment test_greendot.py
gets, one test per run (named on the command line). A thread of the
library's runs the app's code in two places: the continuation (uniffi's
Python code) that wakes an async call's coroutine, on the runtime's
thread, and a listener's `on_event`, on the listener's thread. In each
test that code stays in Python until the interpreter finalizes, or 2 s.

With `greendot_ffi.shutdown` registered with `atexit`, as the README asks,
the exit waits for it and the process exits with 0. With
GREENDOT_EXIT_WITHOUT_SHUTDOWN=1 (the broken variant, which the Rust test
runs too) the thread asks for the GIL while the interpreter finalizes, is
ended under the library's Rust frames, and the process aborts.
"""

import _thread
import asyncio
import atexit
import base64
import json
import os
import sys
import threading
import types
import unittest

sys.path.insert(0, os.environ["GREENDOT_BINDINGS"])
import greendot_ffi as gd  # noqa: E402

if os.environ.get("GREENDOT_EXIT_WITHOUT_SHUTDOWN") != "1":
    atexit.register(gd.shutdown)

# Raw locks, held until released: they work while the interpreter
# finalizes, when module globals may be gone.
finalizing = _thread.allocate_lock()
finalizing.acquire()
returned = _thread.allocate_lock()
returned.acquire()

in_app = threading.Event()


def stay_in_python():
    """A slow app on the library's thread: in Python until the interpreter
    finalizes, or 2 s."""
    in_app.set()
    finalizing.acquire(timeout=2.0)
    returned.release()


slow = threading.Event()
MAIN = threading.get_ident()
original = gd._uniffi_continuation_callback


@gd._UNIFFI_RUST_FUTURE_CONTINUATION_CALLBACK
def slow_continuation(data, poll_code):
    original(data, poll_code)
    if slow.is_set() and threading.get_ident() != MAIN:
        slow.clear()
        stay_in_python()


# Looked up by name at every async call.
gd._uniffi_continuation_callback = slow_continuation


class Finalizing:
    """Dropped when the interpreter finalizes (its modules are removed),
    after it stopped handing the GIL to other threads."""

    def __init__(self, finalizing, returned):
        self.finalizing = finalizing
        self.returned = returned

    def __del__(self):
        self.finalizing.release()
        # Keeps the finalization going (the GIL released) until the
        # continuation has returned, or 2 s: time for its thread to ask for
        # the GIL.
        self.returned.acquire(timeout=2.0)


# In a module of its own: this one's globals stay referenced by the frame
# of the thread that waits in slow_continuation, so they are never dropped.
holder = types.ModuleType("exit_while_called_finalizing")
holder.finalizing = Finalizing(finalizing, returned)
sys.modules[holder.__name__] = holder
del holder


def ca_pem():
    with open(os.environ["GREENDOT_CA_DER"], "rb") as f:
        b64 = base64.b64encode(f.read()).decode()
    lines = [b64[i:i + 64] for i in range(0, len(b64), 64)]
    return "-----BEGIN CERTIFICATE-----\n" + "\n".join(lines) + "\n-----END CERTIFICATE-----\n"


async def connect(name):
    return await gd.connect(
        gd.ConnectConfig(
            addresses=[os.environ["GREENDOT_ADDRESS"]],
            token=json.loads(os.environ["GREENDOT_TOKENS"])[name],
            ca_certificates_pem=ca_pem(),
        )
    )


class SlowListener(gd.PresenceListener):
    def __init__(self):
        self.calls = 0

    def on_event(self, event):
        self.calls += 1
        if self.calls == 1:
            stay_in_python()


LEFT_OPEN = []


class ExitTest(unittest.IsolatedAsyncioTestCase):
    async def test_a_call_completes_as_the_interpreter_exits(self):
        client = await connect("svc")
        slow.set()
        await client.ping()
        # The runtime's thread woke this coroutine and is still in Python.
        self.assertTrue(in_app.wait(4.0), "the ping completed on this thread")

    async def test_a_client_left_open_at_the_exit(self):
        # Kept and never closed, as by an app that exits with it connected.
        LEFT_OPEN.append(await connect("cy"))

    async def test_a_listener_runs_as_the_interpreter_exits(self):
        client = await connect("walt")
        client.listen(SlowListener())
        # The snapshot is the listener's first event.
        await client.subscribe(["bea"], gd.Tier.REALTIME)
        self.assertTrue(in_app.wait(4.0), "the listener was not called")


if __name__ == "__main__":
    unittest.main(verbosity=2)
