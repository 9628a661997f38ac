//! Many datagrams to many destinations in one system call: Linux's
//! `sendmmsg`. quinn-udp sends one transmit per `sendmsg` (GSO batches
//! only datagrams to one destination), while most of what a calm server
//! sends is single datagrams (keep-alives, acknowledgements), each to a
//! client of its own.
//!
//! Each message carries the control messages that quinn-udp's `sendmsg`
//! carries for a single datagram, encoded the same way: the ECN codepoint
//! (`IP_TOS` for IPv4 and IPv4-mapped destinations, `IPV6_TCLASS`
//! otherwise; 0 without ECN, as quinn-udp writes it) and the source
//! address (`IP_PKTINFO`, `IPV6_PKTINFO`). Transmits of several GSO
//! segments are not sent here: they stay on quinn-udp's path, which knows
//! when the kernel refuses segmentation offload.

use std::io;
use std::mem;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::ptr;

/// Datagrams per system call at most.
pub(crate) const BATCH: usize = 32;

/// One datagram to send.
pub(crate) struct Message<'a> {
    pub destination: SocketAddr,
    pub src_ip: Option<IpAddr>,
    pub ecn: Option<quinn_udp::EcnCodepoint>,
    pub contents: &'a [u8],
}

/// Room for one datagram's control messages: the traffic class (an int)
/// and the larger of the two packet infos (`in6_pktinfo`), 56 bytes on
/// Linux.
const CONTROL: usize = 64;

/// A control buffer aligned for `cmsghdr` (its `cmsg_len` is a `size_t`).
#[repr(C, align(8))]
struct Control([u8; CONTROL]);

/// Sends the first [`BATCH`] of `messages` (at most) in order, in one
/// system call; returns how many the kernel took (at least one). An error
/// is the first message's: none was sent (`WouldBlock` when the socket's
/// buffer is full; any other error is that datagram's own).
pub(crate) fn send<'a>(
    socket: &impl AsRawFd,
    messages: impl IntoIterator<Item = Message<'a>>,
) -> io::Result<usize> {
    // SAFETY: all-zero bytes are a valid value of these plain C structs
    // (null pointers, zero lengths).
    let mut names: [libc::sockaddr_storage; BATCH] = unsafe { mem::zeroed() };
    let mut iovs: [libc::iovec; BATCH] = unsafe { mem::zeroed() };
    let mut headers: [libc::mmsghdr; BATCH] = unsafe { mem::zeroed() };
    let mut controls: [Control; BATCH] = std::array::from_fn(|_| Control([0; CONTROL]));
    let mut count = 0;
    for (i, message) in messages.into_iter().take(BATCH).enumerate() {
        let name = socket2::SockAddr::from(message.destination);
        // SAFETY: `name` holds `name.len()` initialised bytes of a socket
        // address, and a `sockaddr_storage` has room for any.
        unsafe {
            ptr::copy_nonoverlapping(
                name.as_ptr().cast::<u8>(),
                ptr::from_mut(&mut names[i]).cast::<u8>(),
                name.len() as usize,
            );
        }
        iovs[i].iov_base = message.contents.as_ptr().cast_mut().cast();
        iovs[i].iov_len = message.contents.len();
        let used = encode_control(&message, &mut controls[i]);
        let hdr = &mut headers[i].msg_hdr;
        hdr.msg_name = ptr::from_mut(&mut names[i]).cast();
        hdr.msg_namelen = name.len();
        hdr.msg_iov = &mut iovs[i];
        hdr.msg_iovlen = 1;
        hdr.msg_control = controls[i].0.as_mut_ptr().cast();
        hdr.msg_controllen = used as _;
        count = i + 1;
    }
    if count == 0 {
        return Ok(0);
    }
    loop {
        // SAFETY: the first `count` headers point into `names`, `iovs`
        // (each to a message's contents, borrowed for 'a) and `controls`,
        // all alive until this function returns; the kernel only reads
        // them and writes each header's `msg_len`.
        let sent =
            unsafe { libc::sendmmsg(socket.as_raw_fd(), headers.as_mut_ptr(), count as _, 0 as _) };
        if sent >= 0 {
            return Ok(sent as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Writes the message's control messages; returns the bytes used.
fn encode_control(message: &Message<'_>, control: &mut Control) -> usize {
    let mut used = 0;
    let ecn = message.ecn.map_or(0, |e| e as libc::c_int);
    let ipv4 = match message.destination.ip() {
        IpAddr::V4(_) => true,
        IpAddr::V6(v6) => v6.to_ipv4_mapped().is_some(),
    };
    if ipv4 {
        put(control, &mut used, libc::IPPROTO_IP, libc::IP_TOS, ecn);
    } else {
        put(
            control,
            &mut used,
            libc::IPPROTO_IPV6,
            libc::IPV6_TCLASS,
            ecn,
        );
    }
    match message.src_ip {
        Some(IpAddr::V4(v4)) => {
            let info = libc::in_pktinfo {
                ipi_ifindex: 0,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.octets()),
                },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            put(control, &mut used, libc::IPPROTO_IP, libc::IP_PKTINFO, info);
        }
        Some(IpAddr::V6(v6)) => {
            let info = libc::in6_pktinfo {
                ipi6_ifindex: 0,
                ipi6_addr: libc::in6_addr {
                    s6_addr: v6.octets(),
                },
            };
            put(
                control,
                &mut used,
                libc::IPPROTO_IPV6,
                libc::IPV6_PKTINFO,
                info,
            );
        }
        None => {}
    }
    used
}

/// Appends one control message at `used`.
fn put<T: Copy>(control: &mut Control, used: &mut usize, level: i32, kind: i32, value: T) {
    let size = mem::size_of::<T>() as libc::c_uint;
    // SAFETY: pure arithmetic on a size.
    let (space, len) = unsafe { (libc::CMSG_SPACE(size) as usize, libc::CMSG_LEN(size)) };
    // The two messages written fit by construction (see `CONTROL`).
    assert!(*used + space <= CONTROL, "control buffer too small");
    // SAFETY: `used` is a sum of `CMSG_SPACE`s, so the header lands
    // aligned in the 8-aligned buffer, and header and data fit (checked
    // above). The data may be less aligned than `T`, hence unaligned.
    unsafe {
        let cmsg = control.0.as_mut_ptr().add(*used).cast::<libc::cmsghdr>();
        (*cmsg).cmsg_level = level;
        (*cmsg).cmsg_type = kind;
        (*cmsg).cmsg_len = len as _;
        ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<T>(), value);
    }
    *used += space;
}

#[cfg(test)]
mod tests {
    use super::*;
    use quinn_udp::{EcnCodepoint, RecvMeta, UdpSocketState};
    use std::io::IoSliceMut;
    use std::net::{Ipv4Addr, UdpSocket};
    use std::time::Duration;

    /// N datagrams to M sockets in one call: all arrive, each at its
    /// socket, from the source address asked, with its ECN codepoint.
    #[test]
    fn one_call_sends_to_many_destinations() {
        const N: usize = 24;
        const M: usize = 5;
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let receivers: Vec<(UdpSocket, UdpSocketState)> = (0..M)
            .map(|_| {
                let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
                socket
                    .set_read_timeout(Some(Duration::from_secs(10)))
                    .unwrap();
                let state = UdpSocketState::new((&socket).into()).unwrap();
                (socket, state)
            })
            .collect();
        let ecns = [None, Some(EcnCodepoint::Ect0), Some(EcnCodepoint::Ce)];
        let payloads: Vec<Vec<u8>> = (0..N).map(|i| vec![i as u8; 40 + i]).collect();
        let messages = (0..N).map(|i| Message {
            destination: receivers[i % M].0.local_addr().unwrap(),
            src_ip: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ecn: ecns[i % ecns.len()],
            contents: &payloads[i],
        });
        assert_eq!(send(&sender, messages).unwrap(), N);

        let from = sender.local_addr().unwrap();
        let mut got = [false; N];
        for (m, (socket, state)) in receivers.iter().enumerate() {
            let mut expected = (0..N).filter(|i| i % M == m).count();
            while expected > 0 {
                let mut buf = [0u8; 2048];
                let mut metas = [RecvMeta::default(); 1];
                let mut iovs = [IoSliceMut::new(&mut buf)];
                let n = state
                    .recv(socket.into(), &mut iovs, &mut metas)
                    .expect("a datagram sent in the call never came");
                assert_eq!(n, 1);
                let meta = metas[0];
                assert_eq!(meta.addr, from);
                // Datagrams of one size may come coalesced (GRO).
                for one in buf[..meta.len].chunks(meta.stride.max(1)) {
                    let i = usize::from(one[0]);
                    assert_eq!(one, &payloads[i][..], "datagram {i} damaged");
                    assert_eq!(i % M, m, "datagram {i} at the wrong socket");
                    assert!(!got[i], "datagram {i} twice");
                    got[i] = true;
                    assert_eq!(meta.ecn, ecns[i % ecns.len()], "datagram {i}'s ECN");
                    expected -= 1;
                }
            }
        }
        assert!(got.iter().all(|g| *g));
    }

    /// More than a batch: one call takes the first [`BATCH`].
    #[test]
    fn one_call_takes_at_most_a_batch() {
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = receiver.local_addr().unwrap();
        let messages = (0..BATCH + 10).map(|_| Message {
            destination: to,
            src_ip: None,
            ecn: None,
            contents: b"x",
        });
        assert_eq!(send(&sender, messages).unwrap(), BATCH);
    }
}
