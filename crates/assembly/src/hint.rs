//! Cache hints for walks over lists that another thread, or the same one long before, wrote:
//! an event's parts, a super-fragment's slices. A hint starts the load and returns; the walk
//! that follows finds the lines in the cache instead of waiting for each.

/// The cache line size of the machines Tessera runs on (x86-64, and most aarch64).
const LINE: usize = 64;

/// Starts loading the line holding `x`; nothing is read architecturally.
#[inline(always)]
pub fn prefetch<X>(x: &X) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch cannot fault and changes no state the program can see; the address
    // is that of a live reference.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (x as *const X).cast(),
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Starts loading every line of `xs`.
#[inline]
pub fn prefetch_all<X>(xs: &[X]) {
    let per_line = (LINE / std::mem::size_of::<X>().max(1)).max(1);
    for x in xs.iter().step_by(per_line) {
        prefetch(x);
    }
    // The last element may start in one line and end in the next.
    if let Some(x) = xs.last() {
        prefetch(x);
    }
}
