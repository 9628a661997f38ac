// A Kotlin/JVM build of the greendot bindings, for users. NOT RUN HERE: the
// machines that build greendot have no Gradle; tests/tests/kotlin_client.rs
// compiles the same sources with kotlinc directly (see README.md, "Tests").
// For Android, use `com.android.library` instead of `kotlin("jvm")`, JNA as
// `net.java.dev.jna:jna:5.13.0@aar`, and put the per-ABI libraries in
// src/main/jniLibs (README.md, "Install").

plugins {
    kotlin("jvm") version "2.4.20"
}

repositories {
    mavenCentral()
}

dependencies {
    implementation("net.java.dev.jna:jna:5.13.0")
    implementation("org.jetbrains.kotlinx:kotlinx-coroutines-core:1.8.0")
}

kotlin {
    jvmToolchain(17)
}

val workspace = rootDir.resolve("../..")
val generated = layout.buildDirectory.dir("generated/uniffi")

// Builds libgreendot_ffi and uniffi-bindgen, then generates the Kotlin
// source from the built library.
val generateBindings by tasks.registering(Exec::class) {
    workingDir = workspace
    outputs.dir(generated)
    commandLine(
        "sh", "-c",
        "cargo build --release -p greendot-ffi -p greendot-uniffi-bindgen && " +
            "target/release/uniffi-bindgen generate --language kotlin --no-format " +
            "--library target/release/libgreendot_ffi.so --out-dir " +
            generated.get().asFile.absolutePath,
    )
}

sourceSets {
    main {
        kotlin.srcDir(generated)
    }
}

tasks.named("compileKotlin") {
    dependsOn(generateBindings)
}

// JNA finds libgreendot_ffi.so in the workspace's target directory.
tasks.withType<JavaExec>().configureEach {
    systemProperty("jna.library.path", workspace.resolve("target/release").absolutePath)
}
