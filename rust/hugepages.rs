//! Transparent huge pages for the big host buffers (KV pools). With THP in `madvise` mode, the
//! common default, only `madvise(MADV_HUGEPAGE)`d memory gets 2 MiB pages; the CPU attention
//! kernel walks 4 KiB tiles scattered over the whole pool, so with 4 KiB pages nearly every tile
//! costs a TLB miss (CPU-ATTN-ANCHOR.md: 2 MiB pages read 8-14% faster here).

/// Huge-page size the advice is aligned to.
pub const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the 2 MiB-aligned part of `[addr, addr + len)` with huge pages;
/// returns how many bytes were advised (0 where unsupported or refused). Pages already touched
/// stay as they are until the kernel collapses them, so call this before first use. Advice
/// never changes memory contents: any range is safe to pass.
pub fn advise_huge_pages(addr: usize, len: usize) -> usize {
    let start = addr.next_multiple_of(HUGE_PAGE);
    let end = addr.saturating_add(len) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return 0;
    }
    advise(start, end - start)
}

#[cfg(target_os = "linux")]
fn advise(start: usize, len: usize) -> usize {
    // SAFETY: MADV_HUGEPAGE only changes how the kernel backs the range, never its contents; an
    // unmapped range is answered with an error, not a fault.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    if rc == 0 {
        len
    } else {
        0
    }
}

#[cfg(not(target_os = "linux"))]
fn advise(_start: usize, _len: usize) -> usize {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advises_only_the_aligned_interior() {
        let buf = vec![0u8; 3 * HUGE_PAGE];
        let addr = buf.as_ptr() as usize;
        let advised = advise_huge_pages(addr, buf.len());
        let interior = (addr + buf.len()) / HUGE_PAGE * HUGE_PAGE - addr.next_multiple_of(HUGE_PAGE);
        assert_eq!(advised, if cfg!(target_os = "linux") { interior } else { 0 });
        assert_eq!(advise_huge_pages(addr, HUGE_PAGE / 2), 0);
    }
}
