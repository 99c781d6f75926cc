//! Kernel tiers and their run-time selection: probed once per `CpuAttention`, overridable with
//! `NEO_RS_SIMD=scalar|avx2|avx512|neon`. Never compiled for the build host (`target-cpu=native`).

use crate::attn::kernel::{self, Item};
use crate::attn::simd::{Portable, Simd};
use crate::attn::split::Kernel;
use crate::attn::types::{dot_kind, Element, Geometry, KvElement, Scratch};
use crate::config;
use crate::error::{NeoError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Scalar, Tier::Avx2, Tier::Avx512, Tier::Neon];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Scalar => "scalar",
            Tier::Avx2 => "avx2",
            Tier::Avx512 => "avx512",
            Tier::Neon => "neon",
        }
    }

    pub fn parse(s: &str) -> Result<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| NeoError::Value(format!("unknown SIMD tier {s:?}; expected scalar, avx2, avx512 or neon")))
    }

    /// Whether this CPU can run the tier.
    pub fn is_supported(self) -> bool {
        match self {
            Tier::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => {
                Tier::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every tier this CPU supports, slowest first.
    pub fn supported() -> Vec<Tier> {
        Tier::ALL.into_iter().filter(|t| t.is_supported()).collect()
    }

    /// The fastest supported tier.
    pub fn best() -> Tier {
        *Tier::supported().last().unwrap_or(&Tier::Scalar)
    }

    /// `NEO_RS_SIMD` if set (an error when this CPU lacks it), else the best tier.
    pub fn from_env() -> Result<Tier> {
        match config::simd_tier() {
            Some(s) => Tier::parse(&s)?.require(),
            None => Ok(Tier::best()),
        }
    }

    /// `self`, or an error when this CPU cannot run it.
    pub fn require(self) -> Result<Tier> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(NeoError::Runtime(format!("SIMD tier {} is not supported by this CPU", self.name())))
        }
    }

    /// The dot products this tier has on this CPU, less those turned off by `NEO_RS_INT8_DOT=0`
    /// or `NEO_RS_BF16_DOT=0`.
    pub fn dot_products(self) -> DotProducts {
        #[cfg(target_arch = "x86_64")]
        if self == Tier::Avx2 {
            let vnni = std::arch::is_x86_feature_detected!("avxvnni");
            return DotProducts { int8: config::int8_dot_allowed() && vnni, bf16: false };
        }
        #[cfg(target_arch = "x86_64")]
        if self == Tier::Avx512 {
            use std::arch::is_x86_feature_detected as has;
            return DotProducts {
                int8: config::int8_dot_allowed() && has!("avx512vnni"),
                bf16: config::bf16_dot_allowed() && has!("avx512bf16"),
            };
        }
        #[cfg(target_arch = "aarch64")]
        if self == Tier::Neon {
            let sdot = std::arch::is_aarch64_feature_detected!("dotprod");
            return DotProducts { int8: config::int8_dot_allowed() && sdot, bf16: false };
        }
        DotProducts::default()
    }

    /// The item function of this tier for q/output type `Q` and KV pools of `K`, on the dot
    /// products `dots` (a subset of `dot_products()`) where they fit `K`.
    pub(crate) fn kernel<Q: Element, K: KvElement>(self, dots: DotProducts) -> Result<Kernel<Q, K>> {
        self.require()?;
        Ok(match self {
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 if K::DOT == dot_kind::INT8 && dots.int8 => {
                Kernel { lanes: 8, item: crate::attn::x86::avx2::attend_item_vnni::<Q, K> }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => Kernel { lanes: 8, item: crate::attn::x86::avx2::attend_item::<Q, K> },
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 if K::DOT == dot_kind::INT8 && dots.int8 => {
                Kernel { lanes: 16, item: crate::attn::x86::avx512::attend_item_vnni::<Q, K> }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 if K::DOT == dot_kind::BF16 && dots.bf16 => {
                Kernel { lanes: 16, item: crate::attn::x86::avx512::attend_item_bf16::<Q, K> }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 => Kernel { lanes: 16, item: crate::attn::x86::avx512::attend_item::<Q, K> },
            #[cfg(target_arch = "aarch64")]
            Tier::Neon if K::DOT == dot_kind::INT8 && dots.int8 => {
                Kernel { lanes: 4, item: crate::attn::aarch64::neon::attend_item_sdot::<Q, K> }
            }
            #[cfg(target_arch = "aarch64")]
            Tier::Neon => Kernel { lanes: 4, item: crate::attn::aarch64::neon::attend_item::<Q, K> },
            _ => Kernel { lanes: Portable::LANES, item: scalar_item::<Q, K> },
        })
    }
}

/// Low-precision dot-product instructions the kernel reads pools with, where they fit the
/// element: `int8` (AVX-512 VNNI or AVX-VNNI: int8 q·k against q quantized per head, int16 p·v
/// against p quantized per head and step; Arm DotProd: the same q·k by `sdot`) and `bf16`
/// (AVX512_BF16: bf16 q·k, p·v against p rounded to bf16).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DotProducts {
    pub int8: bool,
    pub bf16: bool,
}

/// The scalar reference tier's item function.
unsafe fn scalar_item<Q: Element, K: KvElement>(
    it: &Item<'_, Q, K>,
    geo: &Geometry,
    scratch: &mut Scratch,
    partial: &mut [f32],
) {
    // SAFETY: the portable tier runs on any CPU; the scratch contract is forwarded.
    unsafe { kernel::attend_item::<Portable, Q, K, { dot_kind::NONE }>(it, geo, scratch, partial) }
}
