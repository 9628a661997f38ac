//! What the group tests share: a session of a desktop device, and the
//! group outputs drained.

use greendot_core::*;

pub fn connect(core: &mut Core, now: u64, user: u64, device: u64) -> SessionId {
    core.handle_connect(
        Millis(now),
        Connect {
            user: UserId(user),
            device: DeviceId(device),
            kind: DeviceKind::Desktop,
            watch: Watch::All,
            resume: None,
            foreground: true,
        },
    )
    .unwrap()
    .session
}

pub fn drain(core: &mut Core) -> Vec<GroupOutput> {
    std::iter::from_fn(|| core.poll_group_output()).collect()
}
