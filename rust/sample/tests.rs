use super::*;

/// The f64 draw at `u` from `x` as `p` says (torch's sort-based filters, then its inverse CDF in
/// index order), and how far the target is from the nearest boundary of the cumulative masses
/// (relative to the kept mass).
fn reference(x: &[f32], p: RowParams, u: f32) -> (usize, f64) {
    let t = f64::from(p.temperature);
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let w: Vec<f64> =
        x.iter().map(|&v| if v == f32::NEG_INFINITY { 0.0 } else { ((v as f64 - m) / t).exp() }).collect();
    let mut order: Vec<usize> = (0..x.len()).filter(|&i| w[i] > 0.0).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let mass: f64 = order.iter().map(|&i| w[i]).sum();
    let mut before = 0.0;
    order.retain(|&i| {
        let keep = before < f64::from(p.top_p) * mass;
        before += w[i];
        keep
    });
    order.retain(|&i| w[i] >= f64::from(p.min_p));
    let mut kept = vec![0.0; x.len()];
    for &i in &order {
        kept[i] = w[i];
    }
    let total: f64 = kept.iter().sum();
    let target = u as f64 * total;
    let mut c = 0.0;
    for (i, &wi) in kept.iter().enumerate() {
        if wi > 0.0 && c + wi > target {
            return (i, (target - c).min(c + wi - target) / total);
        }
        c += wi;
    }
    unreachable!("u < 1")
}

fn rng(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32) / (1u64 << 24) as f32
}

fn row(seed: &mut u64, vocab: usize, masked: f32, spread: f32) -> Vec<f32> {
    (0..vocab).map(|_| if rng(seed) < masked { f32::NEG_INFINITY } else { (rng(seed) - 0.5) * spread }).collect()
}

/// Draws of every tier at random uniforms against `reference`, wherever the target is not within
/// rounding of a boundary; returns how many were compared.
fn check_draws(x: &[f32], p: RowParams, seed: &mut u64, draws: usize) -> usize {
    let mut checked = 0;
    for tier in Tier::supported() {
        let c = Categorical::new(Some(tier), 1).unwrap();
        for _ in 0..draws {
            let u = rng(seed);
            let mut out = [0u32];
            c.draw(x, x.len(), &[0], &[p], &[u], &mut out).unwrap();
            let (want, margin) = reference(x, p, u);
            assert!(x[out[0] as usize] > f32::NEG_INFINITY, "{tier:?} drew a masked entry");
            if margin > 1e-5 {
                assert_eq!(out[0] as usize, want, "{tier:?} vocab {} {p:?} u {u}", x.len());
                checked += 1;
            }
        }
    }
    checked
}

#[test]
fn every_tier_draws_the_f64_inverse_cdf_token() {
    let mut seed = 7u64;
    let mut checked = 0;
    for &(vocab, masked) in
        &[(1, 0.0), (7, 0.0), (16, 0.3), (255, 0.0), (256, 0.5), (257, 0.1), (4099, 0.0), (49152, 0.9)]
    {
        for &t in &[0.3f32, 1.0, 2.5] {
            let mut x = row(&mut seed, vocab, masked, 16.0);
            x[vocab / 2] = 3.0; // one drawable entry at least
            checked += check_draws(&x, RowParams::plain(t), &mut seed, 20);
        }
    }
    assert!(checked > 400 * Tier::supported().len(), "only {checked} draws far from a boundary");
}

#[test]
fn top_k_top_p_and_min_p_keep_what_the_sorted_filters_keep() {
    let mut seed = 11u64;
    let mut checked = 0;
    // Spreads: a peaked row (the nucleus among the first candidates) and a flat one (top-p
    // reaches past them, down to the whole row).
    for &(vocab, spread) in &[(300, 40.0), (5000, 30.0), (5000, 0.5), (49152, 1.0)] {
        for &(top_k, top_p, min_p) in &[
            (1, 1.0, 0.0),
            (5, 1.0, 0.0),
            (50, 0.9, 0.0),
            (0, 0.9, 0.0),
            (0, 0.3, 0.0),
            (0, 1.0, 0.05),
            (40, 0.8, 0.1),
        ] {
            let x = row(&mut seed, vocab, 0.1, spread);
            let p = RowParams { temperature: 0.7, top_k, top_p, min_p };
            checked += check_draws(&x, p, &mut seed, 10);
        }
    }
    // Most of the mass below the first cut: one entry far above 20,000 that hold 1e-4 of its
    // probability each, so top-p looks again with the second cut.
    let mut x: Vec<f32> = (0..20000).map(|_| 0.7 * 1e-4f32.ln() - 0.5 - rng(&mut seed)).collect();
    x[123] = 0.0;
    checked += check_draws(&x, RowParams { temperature: 0.7, top_k: 0, top_p: 0.9, min_p: 0.0 }, &mut seed, 20);
    assert!(checked > 150 * Tier::supported().len(), "only {checked} draws far from a boundary");
}

#[test]
fn the_ends_of_the_uniform_and_masked_rows() {
    for tier in Tier::supported() {
        let c = Categorical::new(Some(tier), 1).unwrap();
        let mut x = vec![f32::NEG_INFINITY; 1000];
        x[300] = 1.0;
        x[700] = 1.0;
        let mut out = [0u32; 3];
        let below_one = 1.0 - f32::EPSILON / 2.0;
        let plain = [RowParams::plain(1.0); 3];
        c.draw(&x, 1000, &[0, 0, 0], &plain, &[0.0, 0.5, below_one], &mut out).unwrap();
        assert_eq!(out, [300, 700, 700], "{tier:?}");
        // Ties at a cut are kept: top-1 of two equal largest entries keeps both.
        let top1 = [RowParams { top_k: 1, ..RowParams::plain(1.0) }; 3];
        c.draw(&x, 1000, &[0, 0, 0], &top1, &[0.0, 0.5, below_one], &mut out).unwrap();
        assert_eq!(out, [300, 700, 700], "{tier:?}");
        // Rows holding NaN (a broken model) draw an index of the row rather than panic.
        x[500] = f32::NAN;
        let nan = vec![f32::NAN; 1000];
        for row in [&x, &nan] {
            c.draw(row, 1000, &[0, 0, 0], &plain, &[0.0, 0.5, below_one], &mut out).unwrap();
            assert!(out.iter().all(|&t| t < 1000), "{tier:?}");
        }
    }
}

#[test]
fn rows_are_drawn_alone_and_on_a_team() {
    let mut seed = 3u64;
    let vocab = 3000;
    let logits: Vec<f32> = (0..8).flat_map(|_| row(&mut seed, vocab, 0.2, 16.0)).collect();
    let rows = [5usize, 0, 7, 7, 2];
    let params = [
        RowParams::plain(1.0),
        RowParams::plain(0.5),
        RowParams { top_p: 0.5, ..RowParams::plain(2.0) },
        RowParams { top_k: 3, ..RowParams::plain(1.0) },
        RowParams { min_p: 0.2, ..RowParams::plain(0.7) },
    ];
    let us: Vec<f32> = (0..rows.len()).map(|_| rng(&mut seed)).collect();
    let one = Categorical::new(None, 1).unwrap();
    let two = Categorical::new(None, 2).unwrap();
    let (mut a, mut b) = (vec![0u32; 5], vec![0u32; 5]);
    one.draw(&logits, vocab, &rows, &params, &us, &mut a).unwrap();
    two.draw(&logits, vocab, &rows, &params, &us, &mut b).unwrap();
    assert_eq!(a, b);
    for (i, &r) in rows.iter().enumerate() {
        let mut alone = [0u32];
        let x = &logits[r * vocab..(r + 1) * vocab];
        one.draw(x, vocab, &[0], &params[i..=i], &us[i..=i], &mut alone).unwrap();
        assert_eq!(alone[0], a[i]);
    }
}

#[test]
fn bad_arguments_are_refused() {
    let c = Categorical::new(None, 1).unwrap();
    let x = [0.0f32; 8];
    let mut out = [0u32];
    let plain = [RowParams::plain(1.0)];
    assert!(c.draw(&x, 3, &[0], &plain, &[0.5], &mut out).is_err());
    assert!(c.draw(&x, 4, &[2], &plain, &[0.5], &mut out).is_err());
    assert!(c.draw(&x, 4, &[0], &plain, &[1.0], &mut out).is_err());
    assert!(c.draw(&x, 4, &[0, 1], &plain, &[0.5], &mut out).is_err());
    for bad in [
        RowParams::plain(0.0),
        RowParams::plain(f32::INFINITY),
        RowParams { top_p: 0.0, ..RowParams::plain(1.0) },
        RowParams { top_p: 1.5, ..RowParams::plain(1.0) },
        RowParams { min_p: -0.1, ..RowParams::plain(1.0) },
    ] {
        assert!(c.draw(&x, 4, &[0], &[bad], &[0.5], &mut out).is_err(), "{bad:?}");
    }
}
