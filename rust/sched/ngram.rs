//! Prompt-lookup drafting (vLLM's n-gram proposer): a request whose output repeats its own
//! earlier tokens (code edits, summaries quoting the text, retrieval) drafts the tokens that
//! followed the last time its current suffix appeared. No model runs.

/// Up to `max_drafts` tokens to verify after `tokens`: for the longest suffix of `max` down to
/// `min` tokens that occurs earlier in `tokens`, the tokens that followed its latest earlier
/// occurrence. Empty when no suffix recurs.
pub fn propose(tokens: &[u32], (min, max): (usize, usize), max_drafts: usize) -> &[u32] {
    let len = tokens.len();
    if max_drafts == 0 {
        return &[];
    }
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Latest first: a repeated passage is usually being copied from its last occurrence.
        if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
            let from = start + n;
            return &tokens[from..len.min(from + max_drafts)];
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: (usize, usize) = (1, 3);

    #[test]
    fn the_longest_recurring_suffix_drafts_what_followed_its_latest_occurrence() {
        // Suffix [1, 2, 3] occurs at 0 (followed by 4, 5) and at 5 (followed by 9, 9, 9, 1).
        let tokens = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 9, 1, 2, 3];
        assert_eq!(propose(&tokens, SPEC, 4), &[9, 9, 9, 1]);
        assert_eq!(propose(&tokens, SPEC, 2), &[9, 9]);
        assert!(propose(&tokens, SPEC, 0).is_empty());
    }

    #[test]
    fn a_shorter_suffix_is_tried_when_a_longer_one_never_recurs() {
        let tokens = [7, 8, 5, 6, 8];
        assert_eq!(propose(&tokens, SPEC, 4), &[5, 6, 8]); // only [8] recurs
        let strict = (2, 3);
        assert!(propose(&tokens, strict, 4).is_empty());
    }

    #[test]
    fn drafts_stop_at_the_end_of_the_tokens() {
        assert_eq!(propose(&[4, 4], SPEC, 4), &[4]);
        assert!(propose(&[4], SPEC, 4).is_empty());
        assert!(propose(&[1, 2, 3], SPEC, 4).is_empty());
    }
}
