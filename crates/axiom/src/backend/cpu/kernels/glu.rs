use crate::backend::Activation;

/// `out = act(gate) * up`: `silu(g) = g / (1 + e^-g)`, or GELU by its tanh approximation
/// (PyTorch's `gelu(approximate="tanh")`).
pub fn glu(gate: &[f32], up: &[f32], out: &mut [f32], act: Activation) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = activate(g, act) * u;
    }
}

pub fn activate(g: f32, act: Activation) -> f32 {
    match act {
        Activation::Silu => g / (1.0 + (-g).exp()),
        Activation::GeluTanh => {
            let sqrt_2_over_pi = (2.0 / std::f32::consts::PI).sqrt();
            0.5 * g * (1.0 + (sqrt_2_over_pi * (g + 0.044715 * g * g * g)).tanh())
        }
    }
}
