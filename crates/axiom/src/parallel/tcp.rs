//! [`Tcp`]: a group whose ranks are processes (one a rank, on this host or others) meeting over
//! TCP. Rank 0 listens at the group's address and the others connect to it; from then on every
//! message is a frame (a tag byte, a little-endian u32 length in bytes, the payload) between rank
//! 0 and one other rank. Rank 0 hands out the work, and in a collective takes every rank's part,
//! combines them in rank order and sends each the result, so every rank holds the same bits.
//! It carries collectives through the host, for the CPU backend, and the work and NCCL's
//! unique id where NCCL carries them on CUDA.

use super::communicator::{Collective, Communicator};
use crate::backend::{BlockHandle, Kernels};
use crate::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A rank's rank and the group's size, sent by each rank on connecting and by rank 0 back once
/// every rank has.
const HELLO: u8 = 0;
/// u32 words: work, or what rank 0 shares.
const WORDS: u8 = 1;
/// f32 values: a rank's part of a collective, or its result.
const VALUES: u8 = 2;
/// Why the group stopped (UTF-8).
const ABORT: u8 = 3;

/// The largest frame read: far beyond any step's logits, and no allocation a stray byte stream
/// can make huge.
const MAX_FRAME: usize = 1 << 30;

/// One rank's end of a group over TCP.
pub struct Tcp {
    rank: usize,
    size: usize,
    /// On rank 0 the other ranks, in rank order; on the others, rank 0.
    peers: Vec<TcpStream>,
    /// Why the group stopped, once it has.
    stopped: Mutex<Option<String>>,
}

impl Tcp {
    /// Joins the group of `size` ranks meeting at `address` (HOST:PORT) as rank `rank`: rank 0
    /// listens there, the others connect (trying again until rank 0 listens); it returns once
    /// every rank has joined, or fails after `timeout`.
    pub fn join(address: &str, rank: usize, size: usize, timeout: Duration) -> Result<Tcp> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of a tensor-parallel group of {size}"
            )));
        }
        let deadline = Instant::now() + timeout;
        let peers = match rank {
            0 => accept_ranks(address, size, deadline)?,
            _ => vec![connect(address, rank, size, deadline)?],
        };
        for peer in &peers {
            let setup = peer.set_read_timeout(None).and_then(|_| peer.set_nodelay(true));
            setup.map_err(Error::io(format!("setting up the connection to {address}")))?;
        }
        Ok(Tcp {
            rank,
            size,
            peers,
            stopped: Mutex::new(None),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// On rank 0: sends every other rank `words`.
    pub fn send_words(&self, words: &[u32]) -> Result<()> {
        self.check_running()?;
        if self.rank != 0 {
            return Err(Error::InvalidArgument("only rank 0 hands out work".into()));
        }
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        for (i, peer) in self.peers.iter().enumerate() {
            self.send(peer, i + 1, WORDS, &bytes)?;
        }
        Ok(())
    }

    /// On another rank: the next words rank 0 sent, or `None` once rank 0 has closed the
    /// connection or stopped the group.
    pub fn receive_words(&self) -> Result<Option<Vec<u32>>> {
        let peer = match (self.rank, self.peers.first()) {
            (1.., Some(peer)) => peer,
            _ => return Err(Error::InvalidArgument("rank 0 hands out work; it takes none".into())),
        };
        match read_frame(peer) {
            Ok(Some((WORDS, bytes))) => Ok(Some(bytes.chunks_exact(4).map(le_u32).collect())),
            Ok(Some((ABORT, _)) | None) => Ok(None),
            Ok(Some((tag, _))) => Err(self.fail(format!("rank 0 sent a frame of kind {tag} where work was due"))),
            Err(e) => Err(self.fail(format!("reading from rank 0: {e}"))),
        }
    }

    /// This rank's `part` of `collective`, combined with every other rank's (in rank order, on
    /// rank 0).
    pub(crate) fn meet(&self, collective: &Collective, part: Vec<f32>) -> Result<Vec<f32>> {
        self.check_running()?;
        if self.rank > 0 {
            self.send(&self.peers[0], 0, VALUES, &f32_bytes(&part))?;
            return self.receive_values(&self.peers[0], 0, collective.result_len());
        }
        let mut parts = vec![part];
        for (i, peer) in self.peers.iter().enumerate() {
            parts.push(self.receive_values(peer, i + 1, collective.part_len(i + 1))?);
        }
        let result = collective.combine(&parts);
        let bytes = f32_bytes(&result);
        for (i, peer) in self.peers.iter().enumerate() {
            self.send(peer, i + 1, VALUES, &bytes)?;
        }
        Ok(result)
    }

    /// Stops the group: tells the ranks this one talks to why, so that any waiting for it fails.
    pub fn stop(&self, reason: &str) {
        if let Ok(mut stopped) = self.stopped.lock() {
            if stopped.is_some() {
                return;
            }
            *stopped = Some(reason.to_string());
        }
        for peer in &self.peers {
            // A rank already gone needs no telling.
            let _ = write_frame(peer, ABORT, reason.as_bytes());
        }
    }

    fn check_running(&self) -> Result<()> {
        match self.stopped.lock().ok().and_then(|s| s.clone()) {
            Some(reason) => Err(stopped(&reason)),
            None => Ok(()),
        }
    }

    /// Stops the group for `why` and returns the error saying so.
    fn fail(&self, why: String) -> Error {
        self.stop(&why);
        stopped(&why)
    }

    fn send(&self, peer: &TcpStream, rank: usize, tag: u8, payload: &[u8]) -> Result<()> {
        write_frame(peer, tag, payload).map_err(|e| self.fail(format!("sending to rank {rank}: {e}")))
    }

    fn receive_values(&self, peer: &TcpStream, rank: usize, len: usize) -> Result<Vec<f32>> {
        match read_frame(peer) {
            Ok(Some((VALUES, bytes))) if bytes.len() == len * 4 => Ok(bytes.chunks_exact(4).map(le_f32).collect()),
            Ok(Some((VALUES, bytes))) => Err(self.fail(format!(
                "rank {rank} sent {} values in a collective of {len}: the ranks run different steps",
                bytes.len() / 4
            ))),
            Ok(Some((ABORT, reason))) => {
                let reason = String::from_utf8_lossy(&reason).into_owned();
                if let Ok(mut stopped) = self.stopped.lock() {
                    stopped.get_or_insert(reason.clone());
                }
                // Rank 0 passes it on to the ranks still waiting.
                if self.rank == 0 {
                    for peer in &self.peers {
                        let _ = write_frame(peer, ABORT, reason.as_bytes());
                    }
                }
                Err(stopped(&reason))
            }
            Ok(Some((tag, _))) => Err(self.fail(format!("rank {rank} sent a frame of kind {tag} in a collective"))),
            Ok(None) => Err(self.fail(format!("rank {rank} closed its connection"))),
            Err(e) => Err(self.fail(format!("reading from rank {rank}: {e}"))),
        }
    }
}

fn stopped(reason: &str) -> Error {
    Error::Backend(format!("the tensor-parallel group stopped: {reason}"))
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_f32(b: &[u8]) -> f32 {
    f32::from_bits(le_u32(b))
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// One frame, in one write.
fn write_frame(mut stream: &TcpStream, tag: u8, payload: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| std::io::Error::other("a frame over 4 GiB"))?;
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.push(tag);
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(payload);
    stream.write_all(&frame)
}

/// The next frame, or `None` where the connection closed between frames.
fn read_frame(mut stream: &TcpStream) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    let mut header = [0u8; 5];
    match stream.read(&mut header[..1]) {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(None),
        Err(e) => return Err(e),
    }
    stream.read_exact(&mut header[1..])?;
    let len = le_u32(&header[1..]) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!("a frame of {len} bytes")));
    }
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload)?;
    Ok(Some((header[0], payload)))
}

fn hello(rank: usize, size: usize) -> Vec<u8> {
    [rank as u32, size as u32]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
}

/// A HELLO frame's rank and size.
fn read_hello(stream: &TcpStream) -> Result<(usize, usize)> {
    match read_frame(stream) {
        Ok(Some((HELLO, b))) if b.len() == 8 => Ok((le_u32(&b) as usize, le_u32(&b[4..]) as usize)),
        Ok(Some((ABORT, reason))) => Err(stopped(&String::from_utf8_lossy(&reason))),
        Ok(_) => Err(Error::Backend(
            "a tensor-parallel peer that did not introduce itself".into(),
        )),
        Err(e) => Err(Error::Backend(format!("meeting the tensor-parallel group: {e}"))),
    }
}

/// On rank 0: every other rank's connection, in rank order, each told the group is complete.
fn accept_ranks(address: &str, size: usize, deadline: Instant) -> Result<Vec<TcpStream>> {
    let listener = TcpListener::bind(address).map_err(Error::io(format!("listening at --tp-addr {address}")))?;
    listener
        .set_nonblocking(true)
        .map_err(Error::io(format!("listening at --tp-addr {address}")))?;
    let mut ranks: Vec<Option<TcpStream>> = (1..size).map(|_| None).collect();
    while ranks.iter().any(Option::is_none) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let missing: Vec<String> = (1..size)
                    .filter(|&r| ranks[r - 1].is_none())
                    .map(|r| r.to_string())
                    .collect();
                return Err(Error::Backend(format!(
                    "rank 0 waited at {address} for ranks {} of {size}, which did not connect",
                    missing.join(", ")
                )));
            }
            Err(e) => return Err(Error::Backend(format!("accepting a rank at {address}: {e}"))),
        };
        let setup = stream.set_nonblocking(false).and_then(|_| {
            stream.set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ))
        });
        setup.map_err(Error::io(format!("accepting a rank at {address}")))?;
        let (rank, theirs) = read_hello(&stream)?;
        let refused = match () {
            _ if theirs != size => Some(format!(
                "a rank of a group of {theirs} joined rank 0's group of {size}: give every rank the same --tp-size"
            )),
            _ if rank == 0 || rank >= size => Some(format!("rank {rank} joined a group of {size}")),
            _ if ranks[rank - 1].is_some() => Some(format!("two processes joined as rank {rank}")),
            _ => None,
        };
        if let Some(why) = refused {
            let _ = write_frame(&stream, ABORT, why.as_bytes());
            for peer in ranks.iter().flatten() {
                let _ = write_frame(peer, ABORT, why.as_bytes());
            }
            return Err(Error::InvalidArgument(why));
        }
        ranks[rank - 1] = Some(stream);
    }
    let ranks: Vec<TcpStream> = ranks.into_iter().flatten().collect();
    for peer in &ranks {
        write_frame(peer, HELLO, &hello(0, size)).map_err(Error::io("completing the tensor-parallel group"))?;
    }
    Ok(ranks)
}

/// On another rank: the connection to rank 0, once rank 0 says the group is complete.
fn connect(address: &str, rank: usize, size: usize, deadline: Instant) -> Result<TcpStream> {
    let stream = loop {
        let addrs = address
            .to_socket_addrs()
            .map_err(Error::io(format!("resolving --tp-addr {address}")))?;
        match addrs.into_iter().find_map(|a| TcpStream::connect(a).ok()) {
            Some(stream) => break stream,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            None => {
                return Err(Error::Backend(format!(
                    "rank {rank} could not reach rank 0 at {address}"
                )))
            }
        }
    };
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream
        .set_read_timeout(Some(remaining))
        .map_err(Error::io(format!("connecting to {address}")))?;
    write_frame(&stream, HELLO, &hello(rank, size)).map_err(Error::io(format!("joining the group at {address}")))?;
    match read_hello(&stream)? {
        (0, theirs) if theirs == size => Ok(stream),
        (r, theirs) => Err(Error::Backend(format!(
            "rank 0 at {address} answered as rank {r} of {theirs}"
        ))),
    }
}

impl<B: Kernels + ?Sized> Communicator<B> for Tcp {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, backend: &B, x: BlockHandle, n: usize) -> Result<()> {
        Collective::Sum { n }.on_host(backend, self.rank, [x, x], |c, part| self.meet(c, part))
    }

    fn all_gather(
        &self,
        backend: &B,
        part: BlockHandle,
        out: BlockHandle,
        rows: usize,
        widths: &[usize],
    ) -> Result<()> {
        if widths.len() != self.size {
            return Err(Error::InvalidArgument(format!(
                "{} widths for a group of {}",
                widths.len(),
                self.size
            )));
        }
        let collective = Collective::Gather {
            rows,
            widths: widths.to_vec(),
        };
        collective.on_host(backend, self.rank, [part, out], |c, part| self.meet(c, part))
    }

    fn abort(&self, reason: &str) {
        self.stop(reason);
    }

    fn recordable(&self) -> bool {
        false
    }

    fn send_work(&self, work: &[u32]) -> Result<()> {
        self.send_words(work)
    }

    fn next_work(&self) -> Result<Option<Vec<u32>>> {
        self.receive_words()
    }
}
