//! Top-k, top-p and min-p as one threshold on a row's logits: the entries at or above it are kept.
//! Top-k and top-p look at candidates first, the entries within a factor `CUTS[0]` of the largest
//! probability: once these hold the `k` entries or `top_p` of the mass, the sorted prefix that
//! decides lies among them (every candidate outranks every other entry). A row whose candidates
//! fall short is looked at again with a lower cut, at worst whole; top-k sorts only its `k`. A nucleus of SmolLM2's real
//! logits is tens to hundreds of entries; a sort of all 49,152 is what torch did.

use super::{weight, RowParams};

/// Probability relative to the largest below which an entry is not a candidate, tried in turn
/// before the whole row (a try is one pass of compares; a sort of the whole row would cost as
/// much as the draw: a top-50 of SmolLM2's logits at 0.7 often reaches past 1e-4).
const CUTS: [f32; 4] = [1e-4, 1e-8, 1e-16, 1e-32];

/// The logit at or above which `p` keeps the entries of row `x` (largest `m`, `inv_t` one over
/// the temperature), or `None` when it keeps them all. `total(x)`: the row's whole mass, asked
/// for when top-p needs it and top-k is off. `candidates`: scratch.
pub(super) fn threshold(
    x: &[f32],
    m: f32,
    inv_t: f32,
    p: RowParams,
    candidates: &mut Vec<(f32, u32)>,
    total: impl FnOnce(&[f32]) -> f64,
) -> Option<f32> {
    let top_k = (p.top_k > 0 && p.top_k < x.len()).then_some(p.top_k);
    let top_p = (p.top_p < 1.0).then_some(p.top_p);
    let mut cut = f32::NEG_INFINITY;
    if top_k.is_some() || top_p.is_some() {
        cut = nucleus(x, m, inv_t, top_k, top_p, candidates, total);
    }
    if p.min_p > 0.0 {
        // probability / largest = exp((v - m) * inv_t) >= min_p
        cut = cut.max(m + p.min_p.ln() / inv_t);
    }
    (cut > f32::NEG_INFINITY).then_some(cut)
}

/// The smallest logit of the `top_k` largest, then of the shortest prefix of them (largest first)
/// holding `top_p` of their mass: an entry goes when the mass before it reaches `top_p`.
fn nucleus(
    x: &[f32],
    m: f32,
    inv_t: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
    candidates: &mut Vec<(f32, u32)>,
    total: impl FnOnce(&[f32]) -> f64,
) -> f32 {
    let mut total = Some(total);
    let mut row_mass = None;
    for attempt in 0..=CUTS.len() {
        let whole = attempt == CUTS.len();
        let floor = CUTS.get(attempt).map_or(f32::NEG_INFINITY, |r| m + r.ln() / inv_t);
        candidates.clear();
        let unmasked = x.iter().enumerate().filter(|&(_, &v)| v >= floor && v > f32::NEG_INFINITY);
        candidates.extend(unmasked.map(|(i, &v)| (v, i as u32)));
        if top_k.is_some_and(|k| candidates.len() < k) && !whole {
            continue;
        }
        // Largest first, ties by index: only the first `k` are sorted under top-k.
        let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if let Some(k) = top_k.filter(|&k| k < candidates.len()) {
            candidates.select_nth_unstable_by(k - 1, order);
            candidates.truncate(k);
        }
        candidates.sort_unstable_by(order);
        let last = candidates.last().map_or(f32::NEG_INFINITY, |c| c.0);
        let Some(top_p) = top_p else { return last };
        let mass = match top_k {
            Some(_) => candidates.iter().map(|c| f64::from(weight(c.0, m, inv_t))).sum(),
            None => *row_mass.get_or_insert_with(|| (total.take().expect("asked once"))(x)),
        };
        let goal = f64::from(top_p) * mass;
        let mut before = 0.0f64;
        for (j, c) in candidates.iter().enumerate() {
            if before >= goal {
                return candidates[j - 1].0; // j > 0: the goal is above zero
            }
            before += f64::from(weight(c.0, m, inv_t));
        }
        if before >= goal || top_k.is_some() || whole {
            return last; // the nucleus is every candidate, every entry top-k kept, or the whole row
        }
    }
    unreachable!("the last cut takes the whole row")
}
