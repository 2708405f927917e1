//! Compiles axiom's Metal kernels as C++20 against the shim in `shim/`, with the C entry points
//! of `src/launchers.cpp`. The kernels are concatenated as the Metal backend concatenates them
//! (common.metal first), after one rewrite: a statement declaring threadgroup memory (a line that
//! starts with `threadgroup`, ends with `;` and declares no pointer) becomes a static, shared by
//! the threads of a group (groups run one at a time); elsewhere, as in a parameter list or a
//! pointer into threadgroup memory, `threadgroup` is dropped. `AXIOM_MSL_TSAN=1` builds with ThreadSanitizer.

#![allow(clippy::expect_used, reason = "a build script reports failure by panicking")]

use std::path::{Path, PathBuf};

fn main() {
    // AXIOM_METAL_KERNELS points elsewhere to test altered kernels (scripts/metal_planted_bugs.sh).
    println!("cargo:rerun-if-env-changed=AXIOM_METAL_KERNELS");
    let kernels = std::env::var("AXIOM_METAL_KERNELS").unwrap_or_else(|_| "../axiom/src/backend/metal/kernels".into());
    let kernels = Path::new(&kernels);
    let mut names: Vec<String> = std::fs::read_dir(kernels)
        .expect("the Metal kernels directory")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".metal") && n != "common.metal")
        .collect();
    names.sort();
    names.insert(0, "common.metal".into());

    let mut source = String::new();
    for name in &names {
        let path = kernels.join(name);
        let text = std::fs::read_to_string(&path).expect("a kernel source");
        let absolute = path.canonicalize().expect("a kernel path");
        source += &format!("#line 1 \"{}\"\n", absolute.display());
        for line in text.lines() {
            let trimmed = line.trim_start();
            let declaration = trimmed.trim_end_matches([' ', '\\']).ends_with(';');
            let line = match trimmed.strip_prefix("threadgroup ") {
                Some(rest) if declaration && !rest.split(['[', '=']).next().is_some_and(|d| d.contains('*')) => {
                    format!("{}static {rest}", &line[..line.len() - trimmed.len()])
                }
                _ => line.replace("threadgroup ", ""),
            };
            source += &line;
            source.push('\n');
        }
        println!("cargo:rerun-if-changed={}", path.display());
    }
    println!("cargo:rerun-if-changed={}", kernels.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(out.join("kernels.inc"), source).expect("writing the kernels");

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .file("src/launchers.cpp")
        .include("shim")
        .include(&out)
        .flag("-Wno-attributes")
        .flag_if_supported("-Wno-unknown-attributes")
        .opt_level(2);
    println!("cargo:rerun-if-env-changed=AXIOM_MSL_TSAN");
    if std::env::var("AXIOM_MSL_TSAN").is_ok_and(|v| v == "1") {
        // ThreadSanitizer sees races between OS threads, so each GPU thread gets one.
        build
            .flag("-fsanitize=thread")
            .flag("-g")
            .define("MSL_CPU_OS_THREADS", None);
        println!("cargo:rustc-link-lib=tsan");
    }
    build.compile("metal_on_cpu");
    for dep in ["shim/metal_stdlib", "shim/launch.h", "src/launchers.cpp"] {
        println!("cargo:rerun-if-changed={dep}");
    }
}
