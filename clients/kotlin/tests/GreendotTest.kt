// The Kotlin binding against a real greendot server, on the JVM.
//
// Run by tests/tests/kotlin_client.rs (`cargo test --workspace --release`),
// which builds libgreendot_ffi, generates the Kotlin bindings, compiles them
// with this file (kotlinc, JNA, kotlinx-coroutines, kotlin-test), starts a
// server and a UDP relay, runs `main` with `java` and sets:
//
// - GREENDOT_ADDRESS: the server's ip:port; GREENDOT_RELAY: the relay's;
// - GREENDOT_CA_DER: a file with the server's certificate (DER);
// - GREENDOT_TOKENS: JSON, name -> token ("walt" and "wes" (laptops), "svc"
//   (a service token), and one phone per test: "bea", "cy", "dee", "ed",
//   "fay", "gus", "hal", "ida", "jo", and "kai", "lu", "mo" for the group case);
// - GREENDOT_DEBOUNCE_MS: the server's debounce.
//
// The relay is driven over stdout/stdin: the test prints `@@relay cut` or
// `@@relay uncut` and reads one line back once it is done. Results go to
// stderr, ending with `Ran N tests`; the exit status is 1 if any failed.
//
// The same scenarios as clients/python/tests/test_greendot.py. Every wait is
// on an event, with a deadline; nothing sleeps to synchronise.

import kotlin.system.exitProcess
import kotlin.test.assertEquals
import kotlin.test.assertFailsWith
import kotlin.test.assertFalse
import kotlin.test.assertNotEquals
import kotlin.test.assertNotNull
import kotlin.test.assertNull
import kotlin.test.assertTrue
import kotlin.test.fail
import kotlinx.coroutines.Dispatchers
import kotlinx.coroutines.channels.Channel
import kotlinx.coroutines.runBlocking
import kotlinx.coroutines.withContext
import kotlinx.coroutines.withTimeout
import kotlinx.coroutines.withTimeoutOrNull
import uniffi.greendot_ffi.Carrier
import uniffi.greendot_ffi.ClientEvent
import uniffi.greendot_ffi.ConnectConfig
import uniffi.greendot_ffi.DeviceKind
import uniffi.greendot_ffi.GreendotClient
import uniffi.greendot_ffi.GreendotException
import uniffi.greendot_ffi.GroupRole
import uniffi.greendot_ffi.Presence
import uniffi.greendot_ffi.PresenceListener
import uniffi.greendot_ffi.ReconnectSettings
import uniffi.greendot_ffi.Status
import uniffi.greendot_ffi.Tier
import uniffi.greendot_ffi.UpdateSource
import uniffi.greendot_ffi.connect

val ADDRESS: String = System.getenv("GREENDOT_ADDRESS")
val RELAY: String = System.getenv("GREENDOT_RELAY")
val TOKENS: Map<String, String> =
    Regex("\"(\\w+)\": \"([^\"]+)\"").findAll(System.getenv("GREENDOT_TOKENS"))
        .associate { it.groupValues[1] to it.groupValues[2] }
val DEBOUNCE_MS: Long = System.getenv("GREENDOT_DEBOUNCE_MS").toLong()
// Generous for a loaded 2-core machine (as the Rust tests' SLACK).
const val SLACK_MS = 4_000L
// Only a hung test reaches it.
const val TEST_DEADLINE_MS = 60_000L

val CA: String = run {
    val der = java.io.File(System.getenv("GREENDOT_CA_DER")).readBytes()
    val b64 = java.util.Base64.getMimeEncoder(64, "\n".toByteArray()).encodeToString(der)
    "-----BEGIN CERTIFICATE-----\n$b64\n-----END CERTIFICATE-----\n"
}

fun unixMs(): Long = System.currentTimeMillis()

/** Has the Rust harness cut or restore the relay; returns once done. */
suspend fun relay(command: String) {
    println("@@relay $command")
    System.out.flush()
    val line = withContext(Dispatchers.IO) { readlnOrNull() }
    assertEquals("ok", line?.trim(), "relay $command")
}

/** Keeps every event (called on the library's listener thread) and wakes
 * the waiting coroutine. */
open class Recorder : PresenceListener {
    private val events = mutableListOf<ClientEvent>()
    // A wake-up that is never lost: sent after the event is kept.
    private val changed = Channel<Unit>(Channel.CONFLATED)

    override fun onEvent(event: ClientEvent) {
        synchronized(events) { events.add(event) }
        changed.trySend(Unit)
    }

    fun seen(): List<ClientEvent> = synchronized(events) { events.toList() }

    fun reset() = synchronized(events) { events.clear() }

    /** The first event (kept so far or to come) matching `pred`. */
    suspend fun waitFor(what: String, timeoutMs: Long = SLACK_MS, pred: (ClientEvent) -> Boolean): ClientEvent {
        val deadline = System.nanoTime() + timeoutMs * 1_000_000
        while (true) {
            seen().firstOrNull(pred)?.let { return it }
            val left = (deadline - System.nanoTime()) / 1_000_000
            if (left <= 0) fail("no $what within $timeoutMs ms; saw ${seen()}")
            withTimeoutOrNull(left) { changed.receive() }
        }
    }

    suspend fun waitPresence(target: String, timeoutMs: Long = SLACK_MS, pred: (Presence) -> Boolean): Presence {
        val event = waitFor("presence of $target", timeoutMs) {
            it is ClientEvent.PresenceChanged && it.target == target && pred(it.presence)
        }
        return (event as ClientEvent.PresenceChanged).presence
    }

    fun presencesOf(target: String): List<Presence> =
        seen().filterIsInstance<ClientEvent.PresenceChanged>().filter { it.target == target }.map { it.presence }
}

/** One test's clients, closed (without logging out) when it ends. */
class Scope {
    private val clients = mutableListOf<GreendotClient>()

    fun keep(client: GreendotClient): GreendotClient = client.also { clients.add(it) }

    suspend fun connect(name: String, foreground: Boolean = true): GreendotClient =
        keep(connect(ConnectConfig(listOf(ADDRESS), TOKENS.getValue(name), CA, foreground = foreground)))

    /** walt, subscribed to `target` in realtime and seeing them online. */
    suspend fun watch(target: String): Pair<GreendotClient, Recorder> {
        val walt = connect("walt")
        val seen = Recorder()
        walt.listen(seen)
        val answer = walt.subscribe(listOf(target), Tier.REALTIME)
        assertEquals(listOf(target), answer.snapshots.map { it.target })
        assertEquals(emptyList(), answer.refused)
        seen.waitPresence(target) { it.online }
        seen.reset()
        return walt to seen
    }

    suspend fun closeAll() {
        for (client in clients.asReversed()) {
            client.disconnect()
            client.close()
        }
    }
}

suspend fun routed(svc: GreendotClient, user: String): List<String> = svc.route(user).map { it.device }.sorted()

class Case(val name: String, val body: suspend Scope.() -> Unit)

val cases = listOf(
    Case("connect, subscribe and status") {
        val bea = connect("bea")
        assertTrue(bea.isForeground())
        assertEquals("bea" to "phone", bea.user() to bea.device())
        assertNotEquals(0uL, bea.session())
        assertEquals(Carrier.QUIC, bea.carrier())
        val (walt, seen) = watch("bea")

        bea.setStatus(Status.BUSY, "in a meeting")
        val p = seen.waitPresence("bea") { it.status == Status.BUSY }
        assertTrue(p.online)
        assertEquals("in a meeting", p.message)
        assertTrue(DeviceKind.MOBILE in p.kinds)
        // The local view and the server agree.
        assertEquals(p, walt.presence("bea"))
        assertEquals(Status.BUSY, walt.query("bea").status)
        assertNull(walt.presence("nobody"))

        // Unsubscribed: no more events, no local view.
        walt.unsubscribe("bea")
        assertNull(walt.presence("bea"))
    },

    Case("a refused request raises a typed error") {
        val hal = connect("hal")
        // route is for service tokens only.
        val refused = assertFailsWith<GreendotException.Server> { hal.route("cy") }
        assertEquals("ServiceOnly", refused.code)
        assertFailsWith<GreendotException.Config> {
            keep(connect(ConnectConfig(listOf(ADDRESS), "x", "not a PEM")))
        }
        assertFailsWith<GreendotException.Rejected> {
            keep(connect(ConnectConfig(listOf(ADDRESS), "forged", CA)))
        }
    },

    Case("a listener that throws keeps getting events") {
        val ida = connect("ida")
        val walt = connect("walt")
        val seen = object : Recorder() {
            override fun onEvent(event: ClientEvent) {
                super.onEvent(event)
                throw IllegalStateException("a bug in the app's listener")
            }
        }
        walt.listen(seen)
        walt.subscribe(listOf("ida"), Tier.REALTIME)
        seen.waitPresence("ida") { it.online }
        ida.setStatus(Status.BUSY, null)
        seen.waitPresence("ida") { it.status == Status.BUSY }
    },

    Case("invisible") {
        val cy = connect("cy")
        val (_, seen) = watch("cy")
        cy.setInvisible(true)
        val gone = seen.waitPresence("cy") { !it.online }
        assertFalse(gone.invisible, "others are not told she is invisible")
        // Her own view: online and invisible.
        assertTrue(cy.query("cy").invisible)
        cy.setInvisible(false)
        seen.waitPresence("cy") { it.online }
    },

    Case("background is offline, last seen when it went, and routes nowhere") {
        val dee = connect("dee")
        val svc = connect("svc")
        val (_, seen) = watch("dee")
        assertEquals(listOf("phone"), routed(svc, "dee"))

        val wentFrom = unixMs()
        dee.appBackgrounded()
        assertFalse(dee.isForeground())
        // Requests are answered in order: the server took the change.
        dee.ping()
        val wentBy = unixMs()
        // No foreground device: the backend sends a push instead.
        assertEquals(emptyList(), routed(svc, "dee"), "a backgrounded phone is routable")
        val gone = seen.waitPresence("dee", DEBOUNCE_MS + SLACK_MS) { !it.online }
        val lastSeen = assertNotNull(gone.lastSeenMs).toLong()
        assertTrue(
            lastSeen in (wentFrom - 50)..(wentBy + 50),
            "last seen $lastSeen is not when she left ($wentFrom..$wentBy)",
        )
        // The session is kept and answers.
        dee.ping()

        dee.appForegrounded()
        assertTrue(dee.isForeground())
        dee.ping()
        assertEquals(listOf("phone"), routed(svc, "dee"))
        val back = seen.waitPresence("dee", DEBOUNCE_MS + SLACK_MS) { it.online }
        assertNull(back.lastSeenMs)
        val offline = seen.presencesOf("dee").filter { !it.online }
        assertEquals(1, offline.size, "one offline, then online: ${seen.seen()}")
    },

    Case("a quick toggle is never published") {
        val ed = connect("ed")
        val (_, seen) = watch("ed")
        ed.appBackgrounded()
        ed.ping()
        ed.appForegrounded()
        ed.ping()
        // Published once its own debounce held: anything the toggle
        // published would have come before it.
        ed.setStatus(Status.AWAY, null)
        seen.waitPresence("ed", DEBOUNCE_MS + SLACK_MS) { it.status == Status.AWAY }
        val offline = seen.presencesOf("ed").filter { !it.online }
        assertEquals(emptyList(), offline, "a quick toggle flapped")
    },

    Case("started in the background is never shown or routed") {
        val fay = connect("fay", foreground = false)
        val svc = connect("svc")
        assertFalse(fay.isForeground())
        assertEquals(emptyList(), routed(svc, "fay"))
        assertFalse(svc.query("fay").online)
        fay.appForegrounded()
        fay.ping()
        assertEquals(listOf("phone"), routed(svc, "fay"))
    },

    Case("network change and foreground reconnect at once") {
        // Through the relay, with redials a minute apart: a quick reconnect
        // can only come from networkChanged or appForegrounded.
        val minute = ReconnectSettings(initialBackoffMs = 60_000uL, maxBackoffMs = 60_000uL)
        val gus = keep(
            connect(
                ConnectConfig(
                    listOf(RELAY),
                    TOKENS.getValue("gus"),
                    CA,
                    reconnect = minute,
                    requestTimeoutMs = 1_000uL,
                ),
            ),
        )
        val events = Recorder()
        val handle = gus.listen(events)
        // A live connection: the network changes, requests go on.
        gus.networkChanged()
        gus.ping()

        for (wake in listOf("networkChanged", "appForegrounded")) {
            events.reset()
            if (wake == "appForegrounded") gus.appBackgrounded()
            relay("cut")
            events.waitFor("a disconnect", SLACK_MS + 2_000) { it is ClientEvent.Disconnected }
            relay("uncut")
            if (wake == "appForegrounded") gus.appForegrounded() else gus.networkChanged()
            val back = events.waitFor("a reconnect after $wake") { it is ClientEvent.Reconnected }
                as ClientEvent.Reconnected
            assertTrue(back.resumed, "$wake: not resumed: $back")
            // Every welcome names a new session id, resumed or not.
            assertEquals(back.session, gus.session())
            gus.ping()
        }

        // After cancel, the listener hears nothing more; a new one gets
        // what came meanwhile.
        handle.cancel()
        handle.cancel()
        events.reset()
        val later = Recorder()
        gus.logout()
        gus.listen(later)
        val closed = later.waitFor("closed") { it is ClientEvent.Closed } as ClientEvent.Closed
        assertEquals("Logout", closed.code)
        assertEquals(emptyList(), events.seen(), "a cancelled listener was called")
        assertTrue(gus.isClosed())
        assertFailsWith<GreendotException.Closed> { gus.ping() }
    },

    Case("a client nobody reads keeps only the newest presence") {
        val jo = connect("jo")
        val (_, seen) = watch("jo")
        // wes subscribes and registers no listener: his events wait in the
        // client, one presence per target.
        val wes = connect("wes")
        wes.subscribe(listOf("jo"), Tier.REALTIME)
        val changes = List(3) { listOf(Status.BUSY, Status.AWAY) }.flatten()
        for ((i, status) in changes.withIndex()) {
            jo.setStatus(status, "change $i")
            // Published (walt, who reads, sees it) before the next one.
            seen.waitPresence("jo") { it.message == "change $i" }
        }
        val newest = seen.presencesOf("jo").last()
        val late = Recorder()
        wes.listen(late)
        val p = late.waitPresence("jo") { it.message == "change ${changes.size - 1}" }
        assertEquals(newest, p)
        assertEquals(newest, wes.presence("jo"))
        // The snapshot and six changes came while nobody read: at most the
        // newest, and one more if the last push landed after the listener.
        val kept = late.presencesOf("jo")
        assertTrue(kept.size <= 2, "not conflated: $kept")
    },

    Case("groups: counts, members, pages and a watched page") {
        val svc = connect("svc")
        assertEquals(1uL, svc.setGroup(7uL, listOf("kai"), listOf("lu")))

        // kai is a member: counts only, batched. His own connection is the
        // first member online.
        val kai = connect("kai")
        val counts = Recorder()
        kai.listen(counts)
        val member = kai.groupSubscribe(7uL)
        assertEquals(GroupRole.MEMBER to 2u, member.role to member.members)
        fun countIs(n: UInt): (ClientEvent) -> Boolean =
            { it is ClientEvent.GroupCount && it.group == 7uL && it.count == n }
        if (member.count != 1u) counts.waitFor("a count of 1", pred = countIs(1u))

        // lu is an admin: lu's own coming online reaches lu at once, with
        // the count after it; kai gets the count, batched.
        val lu = connect("lu")
        val deltas = Recorder()
        lu.listen(deltas)
        assertEquals(GroupRole.ADMIN, lu.groupSubscribe(7uL).role)
        val delta = deltas.waitFor("lu's own change") {
            it is ClientEvent.GroupMember && it.member == "lu" && it.online
        } as ClientEvent.GroupMember
        assertEquals(2u, delta.count)
        val count = counts.waitFor("a count of 2", pred = countIs(2u)) as ClientEvent.GroupCount
        assertEquals(UpdateSource.BATCHED, count.source)
        assertTrue(counts.seen().none { it is ClientEvent.GroupMember }, "a member got deltas")

        // The member list in pages of one, online first.
        val first = kai.groupPage(7uL, null, 1u)
        assertEquals(1, first.entries.size)
        val last = kai.groupPage(7uL, assertNotNull(first.next), 1u)
        assertNull(last.next)
        val entries = first.entries + last.entries
        assertEquals(listOf("kai", "lu"), entries.map { it.user }.sorted())
        assertTrue(entries.all { it.presence.online })

        // kai watches the first page: lu's new status comes as a delta with
        // lu's whole view, batched (after the debounce, within a batch
        // interval of 2 s).
        val watched = kai.groupWatchPage(7uL, null, 10u)
        assertEquals(listOf("kai", "lu"), watched.entries.map { it.user }.sorted())
        val was = watched.entries.single { it.user == "lu" }.presence
        lu.setStatus(Status.BUSY, "in a meeting")
        val pageDelta = counts.waitFor("lu's change on the watched page", DEBOUNCE_MS + 2_000 + SLACK_MS) {
            it is ClientEvent.GroupPageDelta && it.group == 7uL &&
                it.entries.any { m -> m.user == "lu" && m.presence.status == Status.BUSY }
        } as ClientEvent.GroupPageDelta
        val luNow = pageDelta.entries.single { it.user == "lu" }.presence
        assertEquals(true to "in a meeting", luNow.online to luNow.message)
        assertTrue(luNow.version > was.version, "$luNow after $was")
        // Renewed while shown; unwatched when left, after which there is
        // nothing to renew.
        kai.groupRenewWatch(7uL, null)
        kai.groupUnwatchPage(7uL, null)
        assertEquals("NotSubscribed", assertFailsWith<GreendotException.Server> { kai.groupRenewWatch(7uL, null) }.code)

        // Not a member: a typed refusal. Only a service token writes groups.
        val mo = connect("mo")
        assertEquals("NotMember", assertFailsWith<GreendotException.Server> { mo.groupSubscribe(7uL) }.code)
        assertFailsWith<GreendotException.Server> { kai.setGroup(7uL, listOf("kai"), emptyList()) }

        // kai leaves the group, by difference: his subscription ends. A
        // change expecting another version is refused and changes nothing.
        // Removing the group ends lu's.
        val stale = assertFailsWith<GreendotException.Server> {
            svc.changeGroup(7uL, emptyList(), listOf("kai"), emptyList(), emptyList(), 0uL)
        }
        assertEquals("VersionMismatch", stale.code)
        assertEquals(2uL, svc.changeGroup(7uL, emptyList(), listOf("kai"), emptyList(), emptyList(), 1uL))
        counts.waitFor("the end of kai's") { it is ClientEvent.GroupEnded && it.group == 7uL }
        svc.removeGroup(7uL)
        deltas.waitFor("the end of lu's") { it is ClientEvent.GroupEnded && it.group == 7uL }
    },
)

fun main() {
    var failed = 0
    var ran = 0
    val started = System.nanoTime()
    for (case in cases) {
        val scope = Scope()
        val error = runBlocking {
            try {
                withTimeout(TEST_DEADLINE_MS) { case.body(scope) }
                null
            } catch (e: Throwable) {
                e
            } finally {
                scope.closeAll()
            }
        }
        ran += 1
        if (error == null) {
            System.err.println("${case.name} ... ok")
        } else {
            failed += 1
            System.err.println("${case.name} ... FAIL")
            error.printStackTrace()
        }
    }
    val seconds = (System.nanoTime() - started) / 1e9
    System.err.println("Ran $ran tests in ${"%.1f".format(seconds)}s")
    System.err.println(if (failed == 0) "OK" else "FAILED (failures=$failed)")
    System.err.flush()
    // The library's threads (its runtime, listeners) must not keep the JVM.
    exitProcess(if (failed == 0) 0 else 1)
}
