// swift-tools-version:5.9
// The Swift binding of greendot-ffi. Sources/ and Headers/ are generated
// (generate.sh); the Rust library is built per Apple target and packed
// with Headers/ into greendot_ffiFFI.xcframework (see README.md), which
// provides the `greendot_ffiFFI` module the Swift source imports.
import PackageDescription

let package = Package(
    name: "Greendot",
    platforms: [.iOS(.v15), .macOS(.v12)],
    products: [
        .library(name: "Greendot", targets: ["Greendot"]),
    ],
    targets: [
        .binaryTarget(name: "greendot_ffiFFI", path: "greendot_ffiFFI.xcframework"),
        .target(
            name: "Greendot",
            dependencies: ["greendot_ffiFFI"],
            path: "Sources/Greendot"
        ),
    ]
)
