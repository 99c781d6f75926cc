//! Speculative decoding in the scheduler: a decode drafts by prompt lookup within the budget and
//! blocks the policy left, its rows are all sampled, and `update` keeps the accepted drafts'
//! KV only: rejected blocks go back, never registered in the prefix cache. A draft model's side:
//! the scheduler names the decodes worth drafting for (priced with the draft model's rounds),
//! verifies the tokens handed in like prompt lookup's, and a draft model's own scheduler follows
//! its target by `rewind`, keeping the KV of the tokens they share.

use neo_rs::kv::Device;
use neo_rs::sched::{
    Drafter, OffloadMode, PerfPredictor, RequestId, Scheduler, SchedulerConfig, Speculation, Table1, Table2,
};

const ID: RequestId = RequestId(0);
const PROMPT: [u32; 10] = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3];

fn config(num_gpu_blocks: u32, budget: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        block_size: 2,
        num_gpu_blocks,
        num_cpu_blocks: 0,
        offload: OffloadMode::GpuOnly,
        transfer_bytes_per_decode: 0,
        kv_bytes_per_token: 0,
        force_pipeline: false,
        enable_prefix_caching: true,
        num_cpu_prefix_blocks: 0,
        kv_group_windows: vec![None],
        speculation: Some(Speculation {
            num_tokens: 4,
            drafter: Drafter::PromptLookup { min: 1, max: 2 },
            always: false,
        }),
    }
}

/// A scheduler whose request has run its 10-token prompt and sampled 4: its tokens end in
/// `3, 4`, which appeared before, followed by `5 6 7 1`.
fn after_prefill(cfg: SchedulerConfig, max_tokens: usize) -> Scheduler {
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(ID, PROMPT.to_vec(), max_tokens).unwrap();
    while s.schedule().unwrap().inputs.sample_ids.is_empty() {
        s.update(&[], &[]).unwrap(); // a chunk of the prompt
    }
    s.update(&[4], &[]).unwrap();
    s
}

#[test]
fn a_decode_verifies_its_drafts_and_keeps_only_the_accepted_ones() {
    let mut s = after_prefill(config(16, 64), 20);
    let out = s.schedule().unwrap();
    assert_eq!(out.scheduled[0].num_new_tokens, 5);
    assert_eq!(out.inputs.input_ids, [4, 5, 6, 7, 1]);
    assert_eq!(out.inputs.sample_rows, [0, 1, 2, 3, 4]);
    assert_eq!(out.inputs.sample_ids, [0; 5]);
    // 15 tokens: 8 blocks. Bad counts or tokens change nothing.
    assert_eq!(s.kv(Device::Gpu).table(ID).len(), 8);
    assert!(s.update_speculative(&[5, 6, 9], &[2], &[]).is_err());
    assert!(s.update_speculative(&[5, 7, 9], &[3], &[]).is_err());
    assert!(s.update_speculative(&[5, 6, 7, 1, 2, 3], &[6], &[]).is_err());
    // 5 and 6 accepted, 7 rejected (2 sampled in its place).
    s.update_speculative(&[5, 6, 2], &[3], &[]).unwrap();
    let req = s.request(ID).unwrap();
    assert_eq!(req.token_ids, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 2]);
    assert_eq!((req.num_computed_tokens, req.num_drafts), (13, 0));
    let gpu = s.kv(Device::Gpu);
    assert_eq!((gpu.table(ID).len(), gpu.num_used_blocks()), (7, 7));
    // Six full blocks computed, the seventh holds 6 (kept) and a rejected draft's KV.
    assert_eq!(gpu.num_cached_blocks(), 6);
    s.check_invariants().unwrap();

    // Nothing accepted: only the first row's KV stays.
    let out = s.schedule().unwrap();
    assert_eq!(out.inputs.input_ids, [2, 3, 4, 5, 6]);
    s.update_speculative(&[42], &[1], &[]).unwrap();
    assert_eq!(s.request(ID).unwrap().num_computed_tokens, 14);
    s.abort(ID);
    assert_eq!(s.kv(Device::Gpu).num_used_blocks(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn drafts_fit_max_tokens_the_budget_and_free_blocks_and_never_preempt() {
    // Two tokens left to generate: one draft at most.
    let mut s = after_prefill(config(16, 64), 3);
    assert_eq!(s.schedule().unwrap().scheduled[0].num_new_tokens, 2);
    let finished = s.update_speculative(&[5, 6], &[2], &[]).unwrap();
    assert_eq!(finished.len(), 1, "max_tokens reached");

    // A budget of 3 tokens: two drafts.
    let mut s = after_prefill(config(16, 3), 20);
    assert_eq!(s.schedule().unwrap().scheduled[0].num_new_tokens, 3);
    s.abort_step();

    // Eight blocks: the prompt takes 5, another request 2, the next token the last free one;
    // drafts would need two more, and speculation never preempts to get them.
    let mut s = Scheduler::new(config(8, 64)).unwrap();
    s.add_request(ID, PROMPT.to_vec(), 6).unwrap();
    s.add_request(RequestId(1), vec![8, 9, 10], 3).unwrap();
    s.schedule().unwrap();
    s.update(&[4, 11], &[]).unwrap();
    let out = s.schedule().unwrap();
    assert_eq!(out.scheduled.iter().map(|r| r.num_new_tokens).collect::<Vec<_>>(), [1, 1]);
    assert!(out.recomputed.is_empty() && out.swap_out.pairs.is_empty());
    assert_eq!(s.kv(Device::Gpu).num_free_blocks(), 0);
}

#[test]
fn speculation_settings_are_checked() {
    for (num_tokens, lookup_min, lookup_max) in [(0, 1, 2), (17, 1, 2), (4, 0, 2), (4, 3, 2)] {
        let cfg = SchedulerConfig {
            speculation: Some(Speculation {
                num_tokens,
                drafter: Drafter::PromptLookup { min: lookup_min, max: lookup_max },
                always: false,
            }),
            ..config(16, 64)
        };
        assert!(Scheduler::new(cfg).is_err(), "{num_tokens} {lookup_min} {lookup_max}");
    }
}

/// Drive `s` (one request, after its prompt) for `steps` decodes, rejecting every draft;
/// returns the drafts verified at each step.
fn decode_rejecting(s: &mut Scheduler, steps: usize) -> Vec<usize> {
    (0..steps)
        .map(|_| {
            let drafts = s.schedule().unwrap().scheduled[0].num_new_tokens - 1;
            // Tokens that keep the suffix recurring: 4 then 5 after `... 3`, always drafted.
            s.update_speculative(&[4], &[1], &[]).unwrap();
            drafts
        })
        .collect()
}

#[test]
fn drafts_stop_once_they_are_rejected_and_where_rows_cost_what_they_yield() {
    // One stream, rows nearly free (the synthetic predictor): drafts until rejections teach
    // the scheduler they do not hold; then, as the rates drift back to the prior, a try now and
    // then (about one step in ten here: rows are nearly free), never speculation ended for good.
    let mut s = after_prefill(SchedulerConfig { max_model_len: 1024, ..config(512, 64) }, 1000);
    let drafted = decode_rejecting(&mut s, 900);
    let tries = drafted[600..].iter().filter(|&&d| d > 0).count();
    assert!(drafted[0] > 0 && (1..=300 / 8).contains(&tries), "{drafted:?}");

    // Every row costing as much as the step's fixed part: no draft pays even at the even prior.
    let mut s = after_prefill(config(16, 64), 20);
    let table = |ys: [f64; 2]| Table1::new(vec![1.0, 4096.0], ys.to_vec()).unwrap();
    let flat = Table2::new(vec![1.0, 2.0], vec![0.0, 1.0], vec![0.0; 4]).unwrap();
    *s.predictor_mut() =
        PerfPredictor::new(table([1.0, 4096.0]), table([0.0, 0.0]), flat.clone(), flat, table([0.0, 0.0]), 0.0);
    assert_eq!(s.schedule().unwrap().scheduled[0].num_new_tokens, 1);
}

/// A scheduler whose request ran its prompt and sampled `4`.
fn decoding(drafter: Option<Drafter>) -> Scheduler {
    let speculation = drafter.map(|drafter| Speculation { num_tokens: 4, drafter, always: false });
    let cfg = SchedulerConfig { block_size: 2, enable_prefix_caching: false, speculation, ..config(32, 64) };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(ID, PROMPT.to_vec(), 20).unwrap();
    assert!(s.draft_requests().is_empty(), "a prompt drafts nothing");
    s.schedule().unwrap();
    s.update(&[4], &[]).unwrap();
    s
}

#[test]
fn the_draft_models_tokens_are_verified_as_proposed_and_last_one_step() {
    let mut s = decoding(Some(Drafter::Model));
    // Rows nearly free (the synthetic predictor), the draft model's rounds not yet measured.
    assert_eq!(s.draft_requests(), [(ID, 4, 30)]);
    assert!(s.propose(vec![(RequestId(9), vec![1])]).is_err(), "unknown request");
    assert!(s.propose(vec![(ID, vec![1; 5])]).is_err(), "more than num_speculative_tokens");
    s.propose(vec![(ID, vec![9, 8, 7])]).unwrap();
    let out = s.schedule().unwrap();
    assert!(s.propose(vec![(ID, vec![1])]).is_err(), "between schedule() and update()");
    assert_eq!(out.inputs.input_ids, [4, 9, 8, 7]);
    assert_eq!(out.inputs.sample_ids, [0; 4]);
    // 9 accepted, 8 rejected (5 sampled in its place).
    s.update_speculative(&[9, 5], &[2], &[]).unwrap();
    let req = s.request(ID).unwrap();
    assert_eq!(req.token_ids[10..], [4, 9, 5]);
    assert_eq!(req.num_computed_tokens, 12);
    assert_eq!(s.kv(Device::Gpu).num_used_blocks(), 6);
    s.check_invariants().unwrap();
    // Drafts are for one step: none given, none verified.
    assert_eq!(s.schedule().unwrap().inputs.input_ids, [5]);
    s.update(&[6], &[]).unwrap();
    s.check_invariants().unwrap();

    // Prompt lookup's scheduler takes no tokens and names no request.
    let mut s = decoding(Some(Drafter::PromptLookup { min: 1, max: 2 }));
    assert!(s.draft_requests().is_empty());
    assert!(s.propose(vec![(ID, vec![1])]).is_err());
}

#[test]
fn the_draft_models_rounds_are_priced() {
    let mut s = decoding(Some(Drafter::Model));
    // A round measured at a thousand times the target's linears: no draft pays for it.
    let linear = s.predictor().linear_ms(1);
    s.observe_draft_round(1, 1000.0 * linear);
    assert!(s.draft_requests().is_empty());
    // Rounds measured nearly free again (the newest count most): drafts pay once more.
    for _ in 0..200 {
        s.observe_draft_round(1, 1e-6 * linear);
    }
    assert_eq!(s.draft_requests(), [(ID, 4, 30)]);
}

#[test]
fn rewind_keeps_the_kv_both_token_lists_share() {
    let mut s = decoding(None);
    for t in [5, 6] {
        s.schedule().unwrap();
        s.update(&[t], &[]).unwrap();
    }
    // 13 tokens, 12 computed (7 blocks). The last two replaced: 11 stay computed (6 blocks).
    let mut tokens = PROMPT.to_vec();
    tokens.extend([4, 50, 51]);
    s.rewind(ID, tokens.clone()).unwrap();
    assert_eq!(s.request(ID).unwrap().num_computed_tokens, 11);
    assert_eq!(s.kv(Device::Gpu).num_used_blocks(), 6);
    s.check_invariants().unwrap();
    let out = s.schedule().unwrap();
    assert!(s.rewind(ID, tokens.clone()).is_err(), "between schedule() and update()");
    assert_eq!((out.inputs.input_ids, out.inputs.sample_ids), (vec![50, 51], vec![0]));
    s.update(&[52], &[]).unwrap();
    // The same tokens and one more: all 13 computed stay, two to compute.
    tokens.extend([52, 53]);
    s.rewind(ID, tokens).unwrap();
    assert_eq!(s.request(ID).unwrap().num_computed_tokens, 13);
    assert_eq!(s.schedule().unwrap().inputs.input_ids, [52, 53]);
    s.update(&[54], &[]).unwrap();
    assert!(s.rewind(ID, PROMPT[..9].to_vec()).is_err(), "shorter than the prompt");
    assert!(s.rewind(ID, vec![1; 30]).is_err(), "past max_tokens");
    s.abort(ID);
    assert_eq!(s.kv(Device::Gpu).num_used_blocks(), 0);

    let mut cached = Scheduler::new(SchedulerConfig { speculation: None, ..config(32, 64) }).unwrap();
    cached.add_request(ID, PROMPT.to_vec(), 20).unwrap();
    assert!(cached.rewind(ID, PROMPT.to_vec()).is_err(), "prefix caching");
}
