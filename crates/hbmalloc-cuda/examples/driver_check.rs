//! Hardware check: loads the real CUDA driver, opens every device, runs the
//! same exercise sequence the tests run on the driver double, and prints
//! what it saw, including whether the driver maps part of a handle (the
//! device decides that when it opens, by writing through a part mapping and
//! reading through a whole one). Then it checks what policy `hbm`'s
//! stitching rests on: `hbm` runs a program of allocations and frees on the
//! device and every buffer must keep its own bytes while memory is stitched
//! around it (`byte_check::byte_program`, as the tests run it on the driver
//! double).
//!
//! ```text
//! cargo run -p hbmalloc-cuda --example driver_check
//! ```
//!
//! Exit status: 0 when every check held on every device, 1 when a check
//! failed or a driver call errored, 2 when no CUDA driver was found.

use std::process::ExitCode;

use hbmalloc::{AllocatorConfig, Device, PolicyConfig, StreamId};
use hbmalloc_cuda::byte_check::byte_program;
use hbmalloc_cuda::exercise::exercise_device;
use hbmalloc_cuda::{CudaDevice, CudaDriver, CudaPool};

fn main() -> ExitCode {
    let driver = match CudaDriver::load() {
        Ok(driver) => driver,
        Err(e) => {
            // `load` already says "no CUDA driver found" when it searched;
            // an explicit HBMALLOC_CUDA_DRIVER path fails more tersely.
            if e.detail.starts_with("no CUDA driver found") {
                eprintln!("{}", e.detail);
            } else {
                eprintln!("no CUDA driver found: {}", e.detail);
            }
            return ExitCode::from(2);
        }
    };
    println!("driver: {}", driver.path());
    let count = match driver.device_count() {
        Ok(count) => count,
        Err(e) => {
            eprintln!("the CUDA driver has no usable device: {e}");
            return ExitCode::from(1);
        }
    };
    println!("devices: {count}");
    let mut healthy = count > 0;
    for ordinal in 0..count {
        let device = match CudaDevice::new(driver.clone(), ordinal) {
            Ok(device) => device,
            Err(e) => {
                eprintln!("device {ordinal}: cannot open: {e}");
                healthy = false;
                continue;
            }
        };
        println!(
            "device {ordinal}: {} ({} bytes, granularity {:?}, access from {:?})",
            device.name(),
            device.total_bytes(),
            device.granularity(),
            device.access_ordinals()
        );
        match exercise_device(&device) {
            Ok(report) => {
                println!("device {ordinal}: {report:#?}");
                let failures = report.failures();
                if failures.is_empty() {
                    println!("device {ordinal}: all checks held");
                } else {
                    println!("device {ordinal}: FAILED: {}", failures.join(", "));
                    healthy = false;
                }
            }
            Err(e) => {
                println!("device {ordinal}: driver error: {e}");
                healthy = false;
            }
        }
        println!(
            "device {ordinal}: maps part of a handle: {} (asked of the driver and checked by its bytes)",
            device.maps_handle_parts()
        );
        match check_buffers(device) {
            Ok(summary) => println!("device {ordinal}: {summary}"),
            Err(e) => {
                println!("device {ordinal}: FAILED: hbm byte check: {e}");
                healthy = false;
            }
        }
    }
    if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Policy `hbm` on this device with no allowance (so memory is stitched
/// often), 1,500 allocations and frees on the legacy default stream, every
/// buffer filled with its own byte and read back whole before its free
/// ([`byte_program`]); then everything goes back to the driver.
fn check_buffers(device: CudaDevice) -> Result<String, Box<dyn std::error::Error>> {
    let config = AllocatorConfig {
        policy: PolicyConfig::from_settings("policy:hbm,max_waste_percent:0")?,
        history_entries: 0,
    };
    let pool = CudaPool::with_device(device, config)?;
    let report = byte_program(&*pool, pool.device(), 0, &[StreamId(0)], 1500)?;
    let stats = pool.stats();
    pool.empty_cache()?;
    Ok(format!(
        "hbm byte check: {} buffers kept their bytes ({} driver maps and creates, {} out of memory)",
        report.buffers, stats.num_device_alloc, report.out_of_memory
    ))
}
