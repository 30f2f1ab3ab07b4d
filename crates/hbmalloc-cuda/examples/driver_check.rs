//! Hardware check: loads the real CUDA driver, opens every device, runs the
//! same exercise sequence the tests run on the driver double, and prints
//! what it saw.
//!
//! ```text
//! cargo run -p hbmalloc-cuda --example driver_check
//! ```
//!
//! Exit status: 0 when every check held on every device, 1 when a check
//! failed or a driver call errored, 2 when no CUDA driver was found.

use std::process::ExitCode;

use hbmalloc::Device;
use hbmalloc_cuda::exercise::exercise_device;
use hbmalloc_cuda::{CudaDevice, CudaDriver};

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
    }
    if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
