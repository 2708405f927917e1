/// `x *= factor`.
pub fn scale(x: &mut [f32], factor: f32) {
    x.iter_mut().for_each(|v| *v *= factor);
}

/// `x = cap * tanh(x / cap)`: values squashed smoothly into `(-cap, cap)`.
pub fn softcap(x: &mut [f32], cap: f32) {
    x.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
}
