//! hbmalloc as the memory pool of a cudarc program.
//!
//! `cargo run -p hbmalloc-cuda --example cudarc_pool` on a machine with an
//! NVIDIA GPU: allocates device buffers on a cudarc stream through hbmalloc,
//! copies data through them with cudarc, and prints the pool's statistics.
//! Without a driver it says so and exits with code 2.

use std::process::ExitCode;

use cudarc::driver::{result, CudaContext};
use hbmalloc::StreamId;
use hbmalloc_cuda::{CudaDriver, CudaPool};

fn main() -> ExitCode {
    // cudarc panics when it cannot load libcuda; ask hbmalloc's loader first.
    if let Err(e) = CudaDriver::load() {
        eprintln!("no CUDA driver found: {e}");
        return ExitCode::from(2);
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cudarc_pool: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    // hbmalloc names streams by their raw CUstream handle.
    let stream_id = StreamId(stream.cu_stream() as u64);
    let pool = CudaPool::new(0, "")?;

    let input: Vec<f32> = (0..1 << 20).map(|i| i as f32).collect();
    for step in 0..10 {
        let buffer = pool.alloc(input.len() * std::mem::size_of::<f32>(), stream_id)?;
        let mut output = vec![0f32; input.len()];
        // SAFETY: `buffer` holds `input.len()` f32s of device memory, live
        // until after the stream is synchronized below; the host slices
        // outlive the copies for the same reason.
        unsafe {
            result::memcpy_htod_async(buffer.device_ptr(), &input, stream.cu_stream())?;
            result::memcpy_dtoh_async(&mut output, buffer.device_ptr(), stream.cu_stream())?;
        }
        stream.synchronize()?;
        assert_eq!(output, input, "round trip through hbmalloc memory");
        if step == 0 {
            println!("step 0: buffer at {:#x}", buffer.device_ptr());
        }
        // Dropping the buffer returns it to the pool; the next step reuses it
        // without calling the driver.
    }
    let stats = pool.stats();
    println!(
        "10 steps: {} driver allocations, {} bytes reserved",
        stats.num_device_alloc, stats.reserved_bytes[0].current
    );
    println!("{}", pool.summary());
    Ok(())
}
