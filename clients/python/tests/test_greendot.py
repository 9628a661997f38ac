"""The Python binding against a real greendot server.

Run by tests/tests/python_client.rs (`cargo test --workspace --release`),
which builds libgreendot_ffi, generates greendot_ffi.py next to it, starts a
server and a UDP relay, and sets:

- GREENDOT_BINDINGS: the directory with greendot_ffi.py and the library;
- GREENDOT_ADDRESS: the server's ip:port; GREENDOT_RELAY: the relay's;
- GREENDOT_CA_DER: a file with the server's certificate (DER);
- GREENDOT_TOKENS: JSON, name -> token ("walt" and "wes" (laptops), "svc"
  (a service token), and one phone per test: "bea", "cy", "dee", "ed", "fay",
  "gus", "hal", "ida", "jo", and "kai", "lu", "mo" for the group test);
- GREENDOT_DEBOUNCE_MS: the server's debounce (its group interval is 300 ms).

The relay is driven over stdout/stdin: the test prints `@@relay cut` or
`@@relay uncut` and reads one line back once it is done.

Every wait is on an event, with a deadline; nothing sleeps to synchronise.
"""

import asyncio
import atexit
import base64
import json
import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.environ["GREENDOT_BINDINGS"])
import greendot_ffi as gd  # noqa: E402

# As the README asks of every app: no thread of the library's calls into
# the interpreter once it finalizes.
atexit.register(gd.shutdown)

ADDRESS = os.environ["GREENDOT_ADDRESS"]
RELAY = os.environ["GREENDOT_RELAY"]
TOKENS = json.loads(os.environ["GREENDOT_TOKENS"])
DEBOUNCE = int(os.environ["GREENDOT_DEBOUNCE_MS"]) / 1000
# Generous for a loaded 2-core machine (as the Rust tests' SLACK).
SLACK = 4.0


def ca_pem():
    with open(os.environ["GREENDOT_CA_DER"], "rb") as f:
        b64 = base64.b64encode(f.read()).decode()
    lines = [b64[i:i + 64] for i in range(0, len(b64), 64)]
    return "-----BEGIN CERTIFICATE-----\n" + "\n".join(lines) + "\n-----END CERTIFICATE-----\n"


CA = ca_pem()


def unix_ms():
    return int(time.time() * 1000)


async def relay(command):
    """Has the Rust harness cut or restore the relay; returns once done."""
    print(f"@@relay {command}", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    assert line.strip() == "ok", f"relay {command}: {line!r}"


class Recorder(gd.PresenceListener):
    """Keeps every event (called on the library's listener thread) and wakes
    the test's event loop."""

    def __init__(self, loop):
        self.loop = loop
        self.events = []
        self.lock = threading.Lock()
        self.changed = asyncio.Event()

    def on_event(self, event):
        with self.lock:
            self.events.append(event)
        self.loop.call_soon_threadsafe(self.changed.set)

    def seen(self):
        with self.lock:
            return list(self.events)

    def reset(self):
        with self.lock:
            self.events.clear()

    async def wait_for(self, what, pred, timeout=SLACK):
        """The first event (kept so far or to come) matching `pred`."""
        deadline = time.monotonic() + timeout
        while True:
            self.changed.clear()
            for event in self.seen():
                if pred(event):
                    return event
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout}s; saw {self.seen()}")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def wait_presence(self, target, pred, timeout=SLACK):
        event = await self.wait_for(
            f"presence of {target}",
            lambda e: e.is_PRESENCE_CHANGED() and e.target == target and pred(e.presence),
            timeout,
        )
        return event.presence

    def presences_of(self, target):
        return [e.presence for e in self.seen() if e.is_PRESENCE_CHANGED() and e.target == target]


async def connect(name, **settings):
    return await gd.connect(
        gd.ConnectConfig(addresses=[ADDRESS], token=TOKENS[name], ca_certificates_pem=CA, **settings)
    )


async def watch(test, target):
    """walt, subscribed to `target` in realtime and seeing them online."""
    walt = await connect("walt")
    test.addAsyncCleanup(walt.close)
    seen = Recorder(asyncio.get_running_loop())
    walt.listen(seen)
    answer = await walt.subscribe([target], gd.Tier.REALTIME)
    test.assertEqual([s.target for s in answer.snapshots], [target])
    test.assertEqual(answer.refused, [])
    await seen.wait_presence(target, lambda p: p.online)
    seen.reset()
    return walt, seen


async def routed(svc, user):
    return sorted(e.device for e in await svc.route(user))


class GreendotTest(unittest.IsolatedAsyncioTestCase):
    async def test_connect_subscribe_and_status(self):
        bea = await connect("bea")
        self.addAsyncCleanup(bea.close)
        self.assertTrue(bea.is_foreground())
        self.assertEqual((bea.user(), bea.device()), ("bea", "phone"))
        self.assertNotEqual(bea.session(), 0)
        self.assertEqual(bea.carrier(), gd.Carrier.QUIC)
        walt, seen = await watch(self, "bea")

        await bea.set_status(gd.Status.BUSY, "in a meeting")
        p = await seen.wait_presence("bea", lambda p: p.status == gd.Status.BUSY)
        self.assertTrue(p.online)
        self.assertEqual(p.message, "in a meeting")
        self.assertIn(gd.DeviceKind.MOBILE, p.kinds)
        # The local view and the server agree.
        self.assertEqual(walt.presence("bea"), p)
        self.assertEqual((await walt.query("bea")).status, gd.Status.BUSY)
        self.assertIsNone(walt.presence("nobody"))

        # Unsubscribed: no more events, no local view.
        await walt.unsubscribe("bea")
        self.assertIsNone(walt.presence("bea"))

    async def test_groups_count_members_pages_and_a_watched_page(self):
        svc = await connect("svc")
        self.addAsyncCleanup(svc.close)
        self.assertEqual(await svc.set_group(7, ["kai"], ["lu"]), 1)

        # kai is a member: counts only, batched. His own connection is the
        # first member online.
        kai = await connect("kai")
        self.addAsyncCleanup(kai.close)
        counts = Recorder(asyncio.get_running_loop())
        kai.listen(counts)
        sub = await kai.group_subscribe(7)
        self.assertEqual((sub.role, sub.members), (gd.GroupRole.MEMBER, 2))

        def count_is(n):
            return lambda e: e.is_GROUP_COUNT() and e.group == 7 and e.count == n

        if sub.count != 1:
            await counts.wait_for("a count of 1", count_is(1))

        # lu is an admin: lu's own coming online reaches lu at once, with
        # the count after it; kai gets the count, batched.
        lu = await connect("lu")
        self.addAsyncCleanup(lu.close)
        deltas = Recorder(asyncio.get_running_loop())
        lu.listen(deltas)
        sub = await lu.group_subscribe(7)
        self.assertEqual(sub.role, gd.GroupRole.ADMIN)
        delta = await deltas.wait_for(
            "lu's own change", lambda e: e.is_GROUP_MEMBER() and e.member == "lu" and e.online
        )
        self.assertEqual(delta.count, 2)
        event = await counts.wait_for("a count of 2", count_is(2))
        self.assertEqual(event.source, gd.UpdateSource.BATCHED)
        self.assertFalse(any(e.is_GROUP_MEMBER() for e in counts.seen()), "a member got deltas")

        # The member list in pages of one, online first.
        first = await kai.group_page(7, None, 1)
        self.assertEqual(len(first.entries), 1)
        self.assertIsNotNone(first.next)
        last = await kai.group_page(7, first.next, 1)
        self.assertIsNone(last.next)
        entries = first.entries + last.entries
        self.assertEqual(sorted(e.user for e in entries), ["kai", "lu"])
        self.assertTrue(all(e.presence.online for e in entries))

        # kai watches the first page: lu's new status comes as a delta with
        # lu's whole view, batched (after the debounce, within a batch
        # interval of 2 s).
        watched = await kai.group_watch_page(7, None, 10)
        self.assertEqual(sorted(e.user for e in watched.entries), ["kai", "lu"])
        was = next(e.presence for e in watched.entries if e.user == "lu")
        await lu.set_status(gd.Status.BUSY, "in a meeting")

        def lu_busy(e):
            return (
                e.is_GROUP_PAGE_DELTA()
                and e.group == 7
                and any(m.user == "lu" and m.presence.status == gd.Status.BUSY for m in e.entries)
            )

        event = await counts.wait_for("lu's change on the watched page", lu_busy, DEBOUNCE + 2 + SLACK)
        lu_now = next(m.presence for m in event.entries if m.user == "lu")
        self.assertEqual((lu_now.online, lu_now.message), (True, "in a meeting"))
        self.assertGreater(lu_now.version, was.version)
        # Renewed while shown; unwatched when left, after which there is
        # nothing to renew.
        await kai.group_renew_watch(7, None)
        await kai.group_unwatch_page(7, None)
        with self.assertRaises(gd.GreendotError.Server) as caught:
            await kai.group_renew_watch(7, None)
        self.assertEqual(caught.exception.code, "NotSubscribed")

        # Not a member: a typed refusal.
        mo = await connect("mo")
        self.addAsyncCleanup(mo.close)
        with self.assertRaises(gd.GreendotError.Server) as caught:
            await mo.group_subscribe(7)
        self.assertEqual(caught.exception.code, "NotMember")
        # Only a service token writes groups.
        with self.assertRaises(gd.GreendotError.Server):
            await kai.set_group(7, ["kai"], [])

        # kai leaves the group, by difference: his subscription ends. A
        # change expecting another version is refused and changes nothing.
        with self.assertRaises(gd.GreendotError.Server) as caught:
            await svc.change_group(7, [], ["kai"], [], [], 0)
        self.assertEqual(caught.exception.code, "VersionMismatch")
        self.assertEqual(await svc.change_group(7, [], ["kai"], [], [], 1), 2)
        await counts.wait_for("the end", lambda e: e.is_GROUP_ENDED() and e.group == 7)
        await svc.remove_group(7)
        await deltas.wait_for("the end", lambda e: e.is_GROUP_ENDED() and e.group == 7)

        # A list larger than one frame (64 KiB by default) is written in
        # parts; lu, listed last, is a member: her subscription counts all.
        names = [f"member{i:05}-{'x' * 20}" for i in range(3000)] + ["lu"]
        written = await svc.set_group_in_parts(8, names, [])
        self.assertGreaterEqual(written.requests, 2, written)
        # Each part is one write; a group created after a removal starts
        # above the removed group's version (2), so not at 1.
        self.assertEqual(written.version, 2 + written.requests)
        sub = await lu.group_subscribe(8)
        self.assertEqual(sub.members, 3001)

    async def test_a_refused_request_raises_a_typed_error(self):
        hal = await connect("hal")
        self.addAsyncCleanup(hal.close)
        # route is for service tokens only.
        with self.assertRaises(gd.GreendotError.Server) as caught:
            await hal.route("cy")
        self.assertEqual(caught.exception.code, "ServiceOnly")
        with self.assertRaises(gd.GreendotError.Config):
            await gd.connect(gd.ConnectConfig(addresses=[ADDRESS], token="x", ca_certificates_pem="not a PEM"))
        with self.assertRaises(gd.GreendotError.Rejected):
            await gd.connect(gd.ConnectConfig(addresses=[ADDRESS], token="forged", ca_certificates_pem=CA))

    async def test_a_listener_that_raises_keeps_getting_events(self):
        class Raising(Recorder):
            def on_event(self, event):
                super().on_event(event)
                raise RuntimeError("a bug in the app's listener")

        ida = await connect("ida")
        self.addAsyncCleanup(ida.close)
        walt = await connect("walt")
        self.addAsyncCleanup(walt.close)
        seen = Raising(asyncio.get_running_loop())
        walt.listen(seen)
        await walt.subscribe(["ida"], gd.Tier.REALTIME)
        await seen.wait_presence("ida", lambda p: p.online)
        await ida.set_status(gd.Status.BUSY, None)
        await seen.wait_presence("ida", lambda p: p.status == gd.Status.BUSY)

    async def test_invisible(self):
        cy = await connect("cy")
        self.addAsyncCleanup(cy.close)
        _, seen = await watch(self, "cy")
        await cy.set_invisible(True)
        gone = await seen.wait_presence("cy", lambda p: not p.online)
        self.assertFalse(gone.invisible, "others are not told she is invisible")
        # Her own view: online and invisible.
        self.assertTrue((await cy.query("cy")).invisible)
        await cy.set_invisible(False)
        await seen.wait_presence("cy", lambda p: p.online)

    async def test_background_is_offline_last_seen_when_it_went_and_routes_nowhere(self):
        dee = await connect("dee")
        self.addAsyncCleanup(dee.close)
        svc = await connect("svc")
        self.addAsyncCleanup(svc.close)
        _, seen = await watch(self, "dee")
        self.assertEqual(await routed(svc, "dee"), ["phone"])

        went_from = unix_ms()
        dee.app_backgrounded()
        self.assertFalse(dee.is_foreground())
        # Requests are answered in order: the server took the change.
        await dee.ping()
        went_by = unix_ms()
        # No foreground device: the backend sends a push instead.
        self.assertEqual(await routed(svc, "dee"), [], "a backgrounded phone is routable")
        gone = await seen.wait_presence("dee", lambda p: not p.online, DEBOUNCE + SLACK)
        self.assertIsNotNone(gone.last_seen_ms)
        self.assertTrue(
            went_from - 50 <= gone.last_seen_ms <= went_by + 50,
            f"last seen {gone.last_seen_ms} is not when she left ({went_from}..{went_by})",
        )
        # The session is kept and answers.
        await dee.ping()

        dee.app_foregrounded()
        self.assertTrue(dee.is_foreground())
        await dee.ping()
        self.assertEqual(await routed(svc, "dee"), ["phone"])
        back = await seen.wait_presence("dee", lambda p: p.online, DEBOUNCE + SLACK)
        self.assertIsNone(back.last_seen_ms)
        offline = [p for p in seen.presences_of("dee") if not p.online]
        self.assertEqual(len(offline), 1, f"one offline, then online: {seen.seen()}")

    async def test_a_quick_toggle_is_never_published(self):
        ed = await connect("ed")
        self.addAsyncCleanup(ed.close)
        _, seen = await watch(self, "ed")
        ed.app_backgrounded()
        await ed.ping()
        ed.app_foregrounded()
        await ed.ping()
        # Published once its own debounce held: anything the toggle
        # published would have come before it.
        await ed.set_status(gd.Status.AWAY, None)
        await seen.wait_presence("ed", lambda p: p.status == gd.Status.AWAY, DEBOUNCE + SLACK)
        offline = [p for p in seen.presences_of("ed") if not p.online]
        self.assertEqual(offline, [], "a quick toggle flapped")

    async def test_started_in_the_background_is_never_shown_or_routed(self):
        fay = await connect("fay", foreground=False)
        self.addAsyncCleanup(fay.close)
        svc = await connect("svc")
        self.addAsyncCleanup(svc.close)
        self.assertFalse(fay.is_foreground())
        self.assertEqual(await routed(svc, "fay"), [])
        self.assertFalse((await svc.query("fay")).online)
        fay.app_foregrounded()
        await fay.ping()
        self.assertEqual(await routed(svc, "fay"), ["phone"])

    async def test_network_change_and_foreground_reconnect_at_once(self):
        # Through the relay, with redials a minute apart: a quick reconnect
        # can only come from network_changed or app_foregrounded.
        minute = gd.ReconnectSettings(initial_backoff_ms=60_000, max_backoff_ms=60_000)
        gus = await gd.connect(
            gd.ConnectConfig(
                addresses=[RELAY],
                token=TOKENS["gus"],
                ca_certificates_pem=CA,
                reconnect=minute,
                request_timeout_ms=1_000,
            )
        )
        self.addAsyncCleanup(gus.close)
        events = Recorder(asyncio.get_running_loop())
        handle = gus.listen(events)
        # A live connection: the network changes, requests go on.
        gus.network_changed()
        await gus.ping()

        for wake in ("network_changed", "app_foregrounded"):
            events.reset()
            if wake == "app_foregrounded":
                gus.app_backgrounded()
            await relay("cut")
            await events.wait_for("a disconnect", lambda e: e.is_DISCONNECTED(), SLACK + 2)
            await relay("uncut")
            getattr(gus, wake)()
            back = await events.wait_for(f"a reconnect after {wake}", lambda e: e.is_RECONNECTED())
            self.assertTrue(back.resumed, f"{wake}: not resumed: {back}")
            # Every welcome names a new session id, resumed or not.
            self.assertEqual(gus.session(), back.session)
            await gus.ping()

        # After cancel, the listener hears nothing more; a new one gets
        # what came meanwhile.
        handle.cancel()
        handle.cancel()
        events.reset()
        later = Recorder(asyncio.get_running_loop())
        await gus.logout()
        gus.listen(later)
        closed = await later.wait_for("closed", lambda e: e.is_CLOSED())
        self.assertEqual(closed.code, "Logout")
        self.assertEqual(events.seen(), [], "a cancelled listener was called")
        self.assertTrue(gus.is_closed())
        with self.assertRaises(gd.GreendotError.Closed):
            await gus.ping()

    async def test_a_client_nobody_reads_keeps_only_the_newest_presence(self):
        jo = await connect("jo")
        self.addAsyncCleanup(jo.close)
        walt, seen = await watch(self, "jo")
        # wes subscribes and registers no listener: his events wait in the
        # client, one presence per target.
        wes = await connect("wes")
        self.addAsyncCleanup(wes.close)
        await wes.subscribe(["jo"], gd.Tier.REALTIME)
        changes = [gd.Status.BUSY, gd.Status.AWAY] * 3
        for i, status in enumerate(changes):
            await jo.set_status(status, f"change {i}")
            # Published (walt, who reads, sees it) before the next one.
            await seen.wait_presence("jo", lambda p, i=i: p.message == f"change {i}")
        newest = seen.presences_of("jo")[-1]
        late = Recorder(asyncio.get_running_loop())
        wes.listen(late)
        p = await late.wait_presence("jo", lambda p: p.message == f"change {len(changes) - 1}")
        self.assertEqual(p, newest)
        self.assertEqual(wes.presence("jo"), newest)
        # The snapshot and six changes came while nobody read: at most the
        # newest, and one more if the last push landed after the listener.
        kept = late.presences_of("jo")
        self.assertLessEqual(len(kept), 2, f"not conflated: {kept}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
