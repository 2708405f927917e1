/// The index of the largest value, the first of equal maxima: greedy decoding's choice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// [`argmax`] over the values whose bit is set in `allowed` (value i: bit i % 32 of word i / 32),
/// the others counting as -inf: constrained greedy decoding's choice.
pub fn argmax_within(logits: &[f32], allowed: &[u32]) -> u32 {
    let value = |i: usize| match allowed[i / 32] >> (i % 32) & 1 {
        1 => logits[i],
        _ => f32::NEG_INFINITY,
    };
    let mut best = (0, value(0));
    for (word, &bits) in allowed.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            let i = word * 32 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if i < logits.len() && logits[i] > best.1 {
                best = (i, logits[i]);
            }
        }
    }
    best.0 as u32
}
