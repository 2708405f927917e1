/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `x[t] += bias` for every row of `bias.len()`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add(row, bias);
    }
}

/// `x[t] += sigmoid(gates[t]) * rows[t]` for every row of `width`.
pub fn add_gated(x: &mut [f32], rows: &[f32], gates: &[f32], width: usize) {
    for ((xt, rt), &g) in x.chunks_exact_mut(width).zip(rows.chunks_exact(width)).zip(gates) {
        let s = 1.0 / (1.0 + (-g).exp());
        for (a, &b) in xt.iter_mut().zip(rt) {
            *a += s * b;
        }
    }
}
