//! Every CUDA kernel compiles with NVRTC. Needs only libnvrtc (the `nvidia-cuda-nvrtc` PyPI
//! package; `scripts/test.sh` puts it on the library path), not a GPU, so it runs in CI.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test fails by panicking"
)]

#[test]
fn nvrtc_compiles_every_kernel_for_hopper_and_ampere() {
    for arch in ["sm_90a", "sm_80"] {
        let cubin = axiom::backend::cuda::kernels::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        // An ELF image with our kernels in it.
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}");
        // Every kernel the backend loads at start-up is in it.
        for name in axiom::backend::cuda::kernels::kernel_names(arch) {
            assert!(
                cubin.windows(name.len()).any(|w| w == name.as_bytes()),
                "{arch}: no {name}"
            );
        }
    }
}

/// Each kernel parameter struct has the same size, and each field the same offset, size and kind
/// (int, unsigned, float, 64-bit), in Rust (params.rs) as in CUDA (kernels/params.cuh): NVRTC
/// compiles globals initialised with the CUDA side's values, which the PTX spells out, so no GPU
/// is needed.
#[test]
fn kernel_params_are_laid_out_alike_in_rust_and_cuda() {
    use axiom::backend::cuda::{kernels::SOURCES, params::layouts};
    let headers: String = SOURCES
        .iter()
        .filter(|(name, _)| ["common.cuh", "params.cuh"].contains(name))
        .map(|(_, src)| format!("{src}\n"))
        .collect();
    // What Rust says each probe's value is, by the global that holds CUDA's.
    let mut expected = Vec::new();
    // Each field's kind of scalar, so that an `int` and a `float` (or unsigned) of one size differ:
    // 1 int, 2 unsigned, 3 float, 4 a 64-bit integer or pointer, 0 a struct; arrays their element's.
    let mut probes = String::from(
        "template <class T> struct kind_of { static const unsigned long long value = 0; };\n\
         template <> struct kind_of<int> { static const unsigned long long value = 1; };\n\
         template <> struct kind_of<unsigned> { static const unsigned long long value = 2; };\n\
         template <> struct kind_of<float> { static const unsigned long long value = 3; };\n\
         template <> struct kind_of<unsigned long long> { static const unsigned long long value = 4; };\n\
         template <class T> struct kind_of<T*> { static const unsigned long long value = 4; };\n\
         template <class T, int N> struct kind_of<T[N]> { static const unsigned long long value = kind_of<T>::value; };\n",
    );
    let rust_kind = |ty: &str| {
        let element = ty.trim_start_matches('[').split(';').next().unwrap_or(ty);
        match element {
            "i32" => 1,
            "u32" => 2,
            "f32" => 3,
            "u64" => 4,
            _ => 0,
        }
    };
    let mut probe = |global: String, cuda: String, rust: usize| {
        probes.push_str(&format!("__device__ unsigned long long {global} = {cuda};\n"));
        expected.push((global, rust));
    };
    for layout in layouts() {
        let name = layout.name;
        probe(format!("{name}_size"), format!("sizeof({name})"), layout.size);
        for field in &layout.fields {
            let f = field.name;
            probe(
                format!("{name}_{f}_offset"),
                format!("__builtin_offsetof({name}, {f})"),
                field.offset,
            );
            probe(
                format!("{name}_{f}_size"),
                format!("sizeof((({name}*)0)->{f})"),
                field.size,
            );
            probe(
                format!("{name}_{f}_kind"),
                format!("kind_of<decltype((({name}*)0)->{f})>::value"),
                rust_kind(field.ty),
            );
        }
    }
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some("sm_90a"),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(format!("{headers}{probes}"), options)
        .unwrap_or_else(|e| panic!("{e:?}"))
        .to_src();
    // Lines such as `.global .align 8 .u64 AddParams_n_offset = 16;`; zeros have no initialiser.
    let values: std::collections::HashMap<&str, usize> = ptx
        .lines()
        .filter_map(|line| {
            let (_, global) = line.trim().trim_end_matches(';').split_once(".global .align 8 .u64 ")?;
            Some(match global.split_once(" = ") {
                Some((global, value)) => (global, value.parse().ok()?),
                None => (global, 0),
            })
        })
        .collect();
    for (global, rust) in &expected {
        let cuda = values
            .get(global.as_str())
            .unwrap_or_else(|| panic!("no {global} in the PTX"));
        assert_eq!(cuda, rust, "{global}: CUDA says {cuda}, Rust {rust}");
    }
}

/// Each kernel takes one parameter, as large as the struct the launchers give it (the one
/// `kernel_params_of` names; `launch` refuses any other): the PTX of the whole program spells out
/// each entry's parameters.
#[test]
fn every_kernel_takes_the_struct_its_launcher_passes() {
    use axiom::backend::cuda::{kernels, params::kernel_params_of};
    let arch = "sm_90a";
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into(), "-default-device".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(kernels::program_source(), options)
        .unwrap_or_else(|e| panic!("{e:?}"))
        .to_src();
    // `.visible .entry add(` then one `.param .align 8 .b8 add_param_0[24]` line a parameter.
    let mut entries = std::collections::HashMap::new();
    let mut lines = ptx.lines();
    while let Some(line) = lines.next() {
        let Some((_, rest)) = line.split_once(".entry ") else {
            continue;
        };
        let name = rest.trim_end_matches('(').trim();
        let sizes: Vec<usize> = lines
            .by_ref()
            .take_while(|l| !l.trim().starts_with(')'))
            .map(|l| {
                let size = l
                    .rsplit_once('[')
                    .and_then(|(_, s)| s.trim_end_matches([']', ',']).parse().ok());
                size.unwrap_or_else(|| panic!("{name}: a parameter that is not a struct: {l}"))
            })
            .collect();
        entries.insert(name.to_string(), sizes);
    }
    for name in kernels::kernel_names(arch) {
        let (params, size) = kernel_params_of(&name).unwrap_or_else(|| panic!("{name}: no struct"));
        let sizes = entries.get(&name).unwrap_or_else(|| panic!("{name}: not in the PTX"));
        assert_eq!(
            sizes,
            &[size],
            "{name} takes {sizes:?} bytes; its launcher passes {params}"
        );
    }
}
