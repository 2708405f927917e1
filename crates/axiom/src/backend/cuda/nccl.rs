//! [`Nccl`]: the collectives of a group of processes, one GPU each, through NCCL on the
//! backend's own stream and buffers, so that they queue with the step's kernels and are recorded
//! in its graphs. NCCL is loaded at run time, like the driver, so the binary runs without it. The
//! ranks meet over TCP first ([`Tcp`]), which carries NCCL's unique id and then rank 0's work.

use super::CudaBackend;
use crate::backend::{BlockHandle, Kernels};
use crate::parallel::{Communicator, Tcp};
use crate::{Error, Result};
use cudarc::nccl::{result, sys};
use std::cell::Cell;
use std::ffi::c_void;

/// One rank's end of a group whose collectives run through NCCL.
pub struct Nccl {
    tcp: Tcp,
    comm: sys::ncclComm_t,
    /// Once aborted, the communicator is neither used nor destroyed again.
    aborted: Cell<bool>,
}

// SAFETY: the NCCL communicator is not tied to the thread that made it; it is used through
// `&self` from one thread at a time (Nccl is not Sync).
unsafe impl Send for Nccl {}

fn nccl_error(what: &'static str) -> impl Fn(result::NcclError) -> Error {
    move |e| Error::Backend(format!("NCCL {what}: {:?}", e.0))
}

impl Nccl {
    /// Joins the group `tcp` met as, on `backend`'s GPU: rank 0 makes NCCL's unique id and
    /// hands it to the others over TCP.
    pub fn join(tcp: Tcp, backend: &CudaBackend) -> Result<Nccl> {
        // SAFETY: only probes for the shared library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Backend(
                "NCCL is not installed: the tensor-parallel ranks of CUDA processes need libnccl.so \
                 (pip's nvidia-nccl-cu13 ships it as libnccl.so.2: link it as libnccl.so in a directory on LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        // NVLink multicast stays off unless asked for: the machines this runs on require it.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let id = match tcp.rank() {
            0 => {
                let id = result::get_uniqueid().map_err(nccl_error("unique id"))?;
                tcp.send_words(&id_words(&id))?;
                id
            }
            _ => {
                let words = tcp
                    .receive_words()?
                    .ok_or_else(|| Error::Backend("rank 0 closed the group before sending NCCL's id".into()))?;
                words_id(&words)?
            }
        };
        backend.enter_thread()?;
        let mut comm = std::ptr::null_mut();
        let (size, rank) = (tcp.size() as i32, tcp.rank() as i32);
        // SAFETY: `comm` is written by the call; the id is the group's, every rank passes it.
        unsafe { result::comm_init_rank(&mut comm, size, id, rank) }.map_err(nccl_error("joining the group"))?;
        Ok(Nccl {
            tcp,
            comm,
            aborted: Cell::new(false),
        })
    }

    fn check_running(&self) -> Result<()> {
        match self.aborted.get() {
            true => Err(Error::Backend("the tensor-parallel group stopped".into())),
            false => Ok(()),
        }
    }
}

/// The id as words (it is 128 bytes).
fn id_words(id: &sys::ncclUniqueId) -> Vec<u32> {
    id.internal
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]))
        .collect()
}

fn words_id(words: &[u32]) -> Result<sys::ncclUniqueId> {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    if words.len() * 4 != id.internal.len() {
        return Err(Error::Backend(format!(
            "rank 0 sent an NCCL id of {} words",
            words.len()
        )));
    }
    for (bytes, word) in id.internal.chunks_exact_mut(4).zip(words) {
        for (b, w) in bytes.iter_mut().zip(word.to_le_bytes()) {
            *b = w as _;
        }
    }
    Ok(id)
}

impl Communicator<CudaBackend> for Nccl {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn size(&self) -> usize {
        self.tcp.size()
    }

    fn all_reduce_sum(&self, backend: &CudaBackend, x: BlockHandle, n: usize) -> Result<()> {
        self.check_running()?;
        assert!(n * 4 <= x.len);
        let x = backend.ptr(x) as *mut c_void;
        let stream = backend.stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: `x` holds `n` f32 on this rank's GPU (checked above); in place, as NCCL allows.
        unsafe {
            result::all_reduce(
                x,
                x,
                n,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                self.comm,
                stream,
            )
        }
        .map_err(nccl_error("all-reduce"))?;
        Ok(())
    }

    /// NCCL's all-gather puts equal parts end to end; these parts differ in width and
    /// interleave by row, so each rank's rows are broadcast into place, in one NCCL group.
    fn all_gather(
        &self,
        backend: &CudaBackend,
        part: BlockHandle,
        out: BlockHandle,
        rows: usize,
        widths: &[usize],
    ) -> Result<()> {
        self.check_running()?;
        let total: usize = widths.iter().sum();
        let mine = widths.get(self.rank()).copied().unwrap_or(0);
        if widths.len() != self.size() || rows * mine * 4 > part.len || rows * total * 4 > out.len {
            return Err(Error::InvalidArgument(format!(
                "a gather of {rows} rows of widths {widths:?} over a group of {} into {} bytes",
                self.size(),
                out.len
            )));
        }
        let stream = backend.stream.cu_stream() as sys::cudaStream_t;
        result::group_start().map_err(nccl_error("group"))?;
        let mut first = 0;
        let mut queued = Ok(());
        for (root, &width) in widths.iter().enumerate() {
            for row in 0..rows {
                let src = backend.ptr(part) as usize + row * mine * 4;
                let dst = backend.ptr(out) as usize + (row * total + first) * 4;
                // SAFETY: on the root, `src` is its row `row` (bounds checked above); elsewhere NCCL
                // does not read it. `dst` is the row's columns of this rank's share of `out`.
                let sent = unsafe {
                    result::broadcast(
                        src as *const c_void,
                        dst as *mut c_void,
                        width,
                        sys::ncclDataType_t::ncclFloat32,
                        root as i32,
                        self.comm,
                        stream,
                    )
                };
                queued = queued.and(sent.map(|_| ()));
            }
            first += width;
        }
        // The group is closed whatever was queued, so that NCCL is left in no open group.
        let closed = result::group_end();
        queued.map_err(nccl_error("all-gather"))?;
        closed.map_err(nccl_error("all-gather"))?;
        Ok(())
    }

    fn abort(&self, reason: &str) {
        if !self.aborted.replace(true) {
            // SAFETY: the communicator is live and, marked aborted, never used again.
            let _ = unsafe { result::comm_abort(self.comm) };
        }
        self.tcp.stop(reason);
    }

    fn recordable(&self) -> bool {
        true
    }

    fn send_work(&self, work: &[u32]) -> Result<()> {
        self.tcp.send_words(work)
    }

    fn next_work(&self) -> Result<Option<Vec<u32>>> {
        self.tcp.receive_words()
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if !self.aborted.get() {
            // SAFETY: the communicator is live and used by no one after this.
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}
