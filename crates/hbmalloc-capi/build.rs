//! Compiles `cxx/throw.cc`, the C++ exception behind `hbmalloc_torch_alloc`
//! (see there); `cc` also links the C++ runtime.

fn main() {
    println!("cargo:rerun-if-changed=cxx/throw.cc");
    cc::Build::new()
        .cpp(true)
        .file("cxx/throw.cc")
        .flag_if_supported("-std=c++11")
        .compile("hbmalloc_capi_throw");
}
